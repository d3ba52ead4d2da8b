"""Rendering: the model's own chat template turns a conversation into ``prompt_ids``.

We call ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True,
tokenize=True, **kwargs)`` and never tokenize rendered text ourselves (that is how a second BOS or
a split special token creeps in). transformers 4.x returns a list of ids, 5.x a mapping; both are
accepted. transformers is imported lazily so ``eagle-datagen --help`` stays instant.

Throughput (docs/performance.md): :meth:`Renderer.render_many` renders a chunk of rows with one
``apply_chat_template`` call per distinct ``tools`` list (the template still runs per conversation;
the tokenizer call, its Python overhead and the id conversion are paid once per chunk), about 1.3×
the rows/s of one call per row. A tokenizer that is slow in Python (one shipped as code, loaded with
``trust_remote_code``) gets :class:`RenderPool`: worker processes that each load the tokenizer and
render whole chunks, in order, while the first chunks render in-process until the workers are up.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.prompts import SKIP_FIX, Message, PromptRow

if TYPE_CHECKING:
    from eagle_datagen.inputs.sources import PromptSource

log = logging.getLogger(__name__)

#: Files whose bytes decide how a prompt renders; hashed into the tokenizer fingerprint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
)
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class TokenizerFacts:
    """What verification and the manifest need to know about a tokenizer."""

    path: str
    fingerprint: str
    chat_template_sha256: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    think_open_id: int | None
    think_close_id: int | None


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """Loads a transformers tokenizer and checks that it has a chat template."""
    location = Path(path)
    if not location.exists():
        raise UsageError(
            f"tokenizer path {str(path)!r} does not exist; pass --tokenizer or --model with a local directory"
        )
    # Offline and quiet through arguments, never a lasting os.environ change: a launched server inherits our
    # environment unchanged (it may need the Hub, and its transformers warnings belong in server.log).
    quiet = "TRANSFORMERS_VERBOSITY" not in os.environ
    if quiet:  # transformers reads it once, when first imported (its "PyTorch was not found" line)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as transformers_logging
    finally:
        if quiet:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
    if quiet:
        transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(location), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise UsageError(
                f"the tokenizer at {path} ships its own code; pass --trust-remote-code if you trust it "
                "(it runs that code on this machine)"
            ) from exc
        raise UsageError(f"cannot load a tokenizer from {path}: {exc}") from exc
    except OSError as exc:
        raise UsageError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            f"the tokenizer at {path} has no chat template; use the model's own tokenizer directory "
            "(with chat_template.jinja or a chat_template in tokenizer_config.json)"
        )
    return tokenizer


def tokenizer_fingerprint(path: str | Path) -> str:
    """sha256 over the files that decide rendering (and any tokenizer code shipped with them)."""
    location = Path(path)
    digest = hashlib.sha256()
    names = sorted({*TOKENIZER_FILES, *(p.name for p in location.glob("tokenization_*.py"))})
    for name in names:
        file = location / name
        if file.is_file():
            digest.update(name.encode() + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def tokenizer_facts(tokenizer: Any, path: str | Path) -> TokenizerFacts:
    """Collects vocabulary size, stop ids and think ids from the tokenizer and the model files."""
    template = (
        tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template)
    )
    eos: set[int] = set(generation_eos_ids(path))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return TokenizerFacts(
        path=str(path),
        fingerprint=tokenizer_fingerprint(path),
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest(),
        vocab_size=len(tokenizer),
        eos_token_ids=tuple(sorted(eos)),
        think_open_id=_single_token_id(tokenizer, THINK_OPEN),
        think_close_id=_single_token_id(tokenizer, THINK_CLOSE),
    )


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or ``{}`` when the file is absent or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def generation_eos_ids(path: str | Path) -> list[int]:
    """``eos_token_id`` from generation_config.json and config.json (SGLang stops on their union)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = read_json_file(Path(path) / name).get("eos_token_id")
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
    return ids


def model_vocab_size(path: str | Path) -> int | None:
    """``vocab_size`` from the model's config.json, when there is one."""
    config = read_json_file(Path(path) / "config.json")
    value = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return value if isinstance(value, int) else None


def _single_token_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        return None
    return token_id


# --- the serving path's view of a row ------------------------------------------------------------
#
# SGLang 0.5.23 does not hand a request's messages to the template as sent. ``/v1/chat/completions`` and
# ``/v1/tokenize`` validate them with pydantic models (``entrypoints/openai/protocol.py``) and dump them back
# (``OpenAIServingChat._apply_jinja_template``, ``serving_chat.py``): unknown keys go, ``None`` keys go,
# tool-call arguments given as JSON strings become objects (``normalize_assistant_tool_call_arguments``,
# strict), every tool gains ``"defer_loading": null`` (and ``description``/``parameters`` if absent), tool
# results given as text parts are joined with a space (``normalize_tool_content``), and text parts are
# joined for templates that take a string content (``process_content_for_template_format``). Served traffic
# sees that render, so the client renders the same; the render-parity check (server/tokenize.py) proves it.

#: Fields of SGLang's message models, in their order (``ChatCompletionMessageUserParam`` / ``...GenericParam``).
_USER_FIELDS = ("role", "content")
_MESSAGE_FIELDS = (
    "role", "content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools", "prefix",
)  # fmt: skip
#: Fields of SGLang's ``Function`` model; ``strict`` and ``defer_loading`` are dropped when ``None``.
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def serving_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool schema as SGLang's ``Tool.model_dump()`` gives it to the template (keys in the order sent)."""
    function = tool.get("function") or {}
    defer = tool.get("defer_loading")
    dumped: dict[str, Any] = {
        "description": function.get("description"),
        "name": function.get("name"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    function_defer = function.get("defer_loading", defer) if function.get("defer_loading") is not None else defer
    if function_defer is not None:
        dumped["defer_loading"] = function_defer
    order = [k for k in function if k in dumped] + [k for k in dumped if k not in function]
    return {"type": tool.get("type", "function"), "function": {k: dumped[k] for k in order}, "defer_loading": defer}


def serving_tool_call(call: Mapping[str, Any], *, string_arguments: bool = False) -> dict[str, Any]:
    """One assistant tool call as SGLang's ``ToolCall.model_dump()`` gives it, arguments parsed into an object
    (or, for a template that needs a string, kept or serialized as one)."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if string_arguments:
        if arguments is not None and not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
    elif isinstance(arguments, str):
        arguments = orjson.loads(arguments)  # rows are validated when read (inputs/prompts.py)
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": arguments},
    }


def serving_message(
    message: Mapping[str, Any], *, keeps_content_parts: bool, string_arguments: bool = False
) -> Message:
    """One message as SGLang's chat path hands it to a Jinja template."""
    fields = _USER_FIELDS if message.get("role") == "user" else _MESSAGE_FIELDS
    out: Message = {}
    for key in fields:
        value = message.get(key)
        if key == "content" and value is None:
            value = ""
        if value is None:
            continue
        if key == "tool_calls" and isinstance(value, list):
            value = [serving_tool_call(c, string_arguments=string_arguments) for c in value]
        elif key == "tools" and isinstance(value, list):
            value = [serving_tool(t) for t in value]
        out[key] = value
    content = out["content"]
    if isinstance(content, list):
        texts = [p["text"] if isinstance(p, dict) else p for p in content]
        if out["role"] == "tool" or not keeps_content_parts:
            out["content"] = " ".join(texts)
        else:  # the parts list moves to the end, as process_content_for_template_format rebuilds it
            del out["content"]
            out["content"] = [{"type": "text", "text": t} for t in texts]
    return out


# --- what a template does, found by rendering -----------------------------------------------------

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_PROBE_ARGUMENTS = {"city": "Paris"}


def _probe_conversation() -> list[Message]:
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": _probe_call()}],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]


def _probe_call() -> dict[str, Any]:
    return {"name": "get_weather", "arguments": dict(_PROBE_ARGUMENTS)}


@dataclass(frozen=True)
class TemplateTraits:
    """What rendering probe conversations showed about a chat template."""

    #: Objects make the template raise or print a Python repr, while strings render: arguments go as strings.
    needs_string_arguments: bool
    #: A tool schema changes nothing in the render: the template drops ``tools`` (DeepSeek R1 / V3.1).
    drops_tools: bool
    #: The template calls ``strftime_now``: its renders depend on the date (gpt-oss).
    date_dependent: bool


_MEDIA_WORDS = ("image", "audio", "video", "vision")


def template_keeps_content_parts(template: str) -> bool:
    """Whether SGLang's chat path hands this template content as a list of parts (its ``'openai'`` format)
    rather than joined text: ``detect_jinja_template_content_format`` (``sglang/srt/parser/
    jinja_template_utils.py``, 0.5.23), ported. A template naming any media word is taken as ``'openai'``;
    otherwise one that loops over ``message.content`` / ``msg.content`` / ``m.content`` (with filters,
    tests or slices) is."""
    if not template:
        return False
    if any(word in template for word in _MEDIA_WORDS):
        return True
    import jinja2
    from jinja2 import nodes

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        try:
            ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        except jinja2.TemplateError:
            return False

    def reads_content(node: nodes.Node, name: str) -> bool:
        if isinstance(node, (nodes.Filter, nodes.Test)):
            return node.node is not None and reads_content(node.node, name)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            return reads_content(node.node, name)
        if isinstance(node, nodes.Getitem):
            return _is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return _is_name(node.node, name) and node.attr == "content"
        return False

    return any(reads_content(loop.iter, name) for loop in ast.find_all(nodes.For) for name in ("message", "msg", "m"))


def _is_name(node: Any, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def template_calls_strftime(template: Any) -> bool:
    """True when a chat template (or any of a dict of named templates) reads ``strftime_now``."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    templates = template.values() if isinstance(template, Mapping) else [template]
    for text in templates:
        if not isinstance(text, str):
            continue
        try:
            names = meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text))
        except TemplateSyntaxError:
            names = {"strftime_now"} if "strftime_now" in text else set()
        if "strftime_now" in names:
            return True
    return False


#: strftime directives a pinned ``strftime_now`` answers (the glibc ``%-d`` forms too); the time is 00:00:00.
_STRFTIME_CODES = "aAwdbBmyYHIpMSfzZjUWcxXGuV"
_STRFTIME_DASHED = "dmHIMSj"


def pin_template_date(template: str, day: datetime.date) -> str:
    """``template`` with ``strftime_now(format)`` answering for ``day`` instead of today.

    transformers gives templates a global ``strftime_now`` that reads the clock; a macro of the same name
    defined first shadows it everywhere in the template. It substitutes each directive in the format with
    its value for ``day`` at 00:00 (``%%`` stays a percent sign). The newline after the macro is eaten by
    the environment's ``trim_blocks``, so the rest renders byte for byte as before.
    """
    moment = datetime.datetime.combine(day, datetime.time())
    pairs = [("%%", "\x00")]
    pairs += [(f"%-{c}", str(int(moment.strftime(f"%{c}")))) for c in _STRFTIME_DASHED]
    pairs += [(f"%{c}", moment.strftime(f"%{c}")) for c in _STRFTIME_CODES]
    chain = "".join(f"|replace({json.dumps(a)}, {json.dumps(b)})" for a, b in pairs)
    chain += '|replace("\x00", "%")'
    return "{% macro strftime_now(format) %}{{ format" + chain + " }}{% endmacro %}\n" + template


def parse_render_date(value: str | datetime.date | None) -> datetime.date | None:
    """``--render-date YYYY-MM-DD`` (or a date, or ``None``)."""
    if value is None or isinstance(value, datetime.date):
        return value
    try:
        return datetime.date.fromisoformat(value)
    except ValueError:
        raise UsageError(f"--render-date must be a date as YYYY-MM-DD, got {value!r}") from None


class Renderer:
    """Renders prompt rows with one tokenizer and one set of chat-template kwargs, the way SGLang's chat
    path renders them (:func:`serving_message`, :func:`serving_tool`).

    ``render_date`` pins what ``strftime_now`` answers in a date-dependent template (the run's date, from
    the manifest); ``None`` leaves the template reading the clock.
    """

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        render_date: datetime.date | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.render_date = render_date
        raw = tokenizer.chat_template
        template = raw if isinstance(raw, str) else ""
        self.keeps_content_parts = template_keeps_content_parts(template)
        date_dependent = template_calls_strftime(raw)
        self._templates: dict[str, str] | None = None
        if date_dependent and render_date is not None:
            named = raw if isinstance(raw, Mapping) else {"default": raw}
            self._templates = {k: pin_template_date(v, render_date) for k, v in named.items() if isinstance(v, str)}
        self.string_arguments = False
        self.traits = self._probe(date_dependent)
        self.string_arguments = self.traits.needs_string_arguments

    def render(self, row: PromptRow, path: str = "<prompts>") -> list[int]:
        """``prompt_ids`` for ``row``; a template error becomes a :class:`BadInputError`."""
        messages = self.template_messages(row)
        tools = self.template_tools(row)
        try:
            result = self._apply([messages], tools, tokenize=True, kwargs=self.kwargs_for(row))
        except Exception as exc:
            raise BadInputError(
                path, row.line, "template_error", f"the chat template raised{_describe(exc)}", SKIP_FIX
            ) from exc
        return as_token_ids(result)

    def kwargs_for(self, row: PromptRow) -> dict[str, Any]:
        """The template kwargs of one row: the renderer's, with the row's own (a mix's variant) over them."""
        return {**self.template_kwargs, **row.template_kwargs} if row.template_kwargs else self.template_kwargs

    def template_messages(self, row: PromptRow) -> list[Message]:
        """The row's messages as the template sees them (the serving path's view)."""
        return [self._template_message(m) for m in row.messages]

    def template_tools(self, row: PromptRow) -> list[dict[str, Any]] | None:
        return [serving_tool(t) for t in row.tools] if row.tools else None

    def _apply(
        self,
        conversations: list[list[Message]],
        tools: list[dict[str, Any]] | None,
        *,
        tokenize: bool,
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """``apply_chat_template`` as the serving path calls it: when the template raises with the tools as
        given, once more with bare function schemas (``serving_chat.py`` does the same for Mistral-style
        templates)."""
        batch: Any = conversations if len(conversations) > 1 else conversations[0]
        kwargs = self.template_kwargs if kwargs is None else kwargs
        try:
            return self._call(batch, tools, tokenize, kwargs)
        except Exception:
            if not tools:
                raise
            flat = [t.get("function", t) for t in tools]
            return self._call(batch, flat, tokenize, kwargs)

    def _call(self, batch: Any, tools: list[dict[str, Any]] | None, tokenize: bool, kwargs: Mapping[str, Any]) -> Any:
        extra: dict[str, Any] = {}
        if self._templates is not None:
            name = "tool_use" if tools and "tool_use" in self._templates else "default"
            extra["chat_template"] = self._templates.get(name) or next(iter(self._templates.values()))
        return self.tokenizer.apply_chat_template(
            batch, tools=tools, add_generation_prompt=True, tokenize=tokenize, **extra, **kwargs
        )

    def _probe(self, date_dependent: bool) -> TemplateTraits:
        def text(messages: list[Message], tools: list[dict[str, Any]] | None, strings: bool) -> str | None:
            view = [
                serving_message(m, keeps_content_parts=self.keeps_content_parts, string_arguments=strings)
                for m in messages
            ]
            try:
                out = self._apply([view], tools, tokenize=False)
            except Exception:
                return None
            return out if isinstance(out, str) else None

        tools = [serving_tool(_PROBE_TOOL)]
        as_objects = text(_probe_conversation(), tools, False)
        as_strings = text(_probe_conversation(), tools, True)
        objects_fail = as_objects is None or repr(_PROBE_ARGUMENTS) in as_objects
        hello: list[Message] = [{"role": "user", "content": "hello"}]
        plain = text(hello, None, False)
        with_tools = text(hello, tools, False)
        return TemplateTraits(
            needs_string_arguments=objects_fail and as_strings is not None,
            drops_tools=plain is not None and plain == with_tools,
            date_dependent=date_dependent,
        )

    def render_many(self, rows: Sequence[PromptRow], path: str = "<prompts>") -> list[Rendered]:
        """``prompt_ids`` for each row, in order; a row the template rejects gets its :class:`BadInputError`.

        One ``apply_chat_template`` call per distinct ``tools`` list in ``rows``; the ids are the same as
        :meth:`render` gives row by row (each conversation is rendered and tokenized on its own). When
        the template raises inside a batch, that batch is rendered row by row to find the bad rows.
        """
        groups: dict[bytes, list[int]] = {}
        for index, row in enumerate(rows):
            key = b"" if row.tools is None else orjson.dumps(row.tools)
            if row.template_kwargs:  # a mix's variant: rows render together only with the same kwargs
                key += b"\0" + orjson.dumps(row.template_kwargs, option=orjson.OPT_SORT_KEYS)
            groups.setdefault(key, []).append(index)
        results: list[Rendered] = [[] for _ in rows]
        for indices in groups.values():
            group = [rows[i] for i in indices]
            for index, rendered in zip(indices, self._render_group(group, path), strict=True):
                results[index] = rendered
        return results

    def render_chunks(self, chunks: Iterable[Sequence[PromptRow]], path: str = "<prompts>") -> Iterator[list[Rendered]]:
        """:meth:`render_many` over each chunk, in order (the in-process counterpart of :class:`RenderPool`)."""
        for chunk in chunks:
            yield self.render_many(chunk, path)

    def _render_group(self, rows: Sequence[PromptRow], path: str) -> list[Rendered]:
        if len(rows) > 1:
            try:
                result = self._apply(
                    [self.template_messages(row) for row in rows],
                    self.template_tools(rows[0]),
                    tokenize=True,
                    kwargs=self.kwargs_for(rows[0]),
                )
                return list(as_batch_token_ids(result, len(rows)))
            except Exception:  # some row is bad: find it row by row
                pass
        return [self._render_or_error(row, path) for row in rows]

    def _render_or_error(self, row: PromptRow, path: str) -> Rendered:
        try:
            return self.render(row, path)
        except BadInputError as exc:
            return exc

    def _template_message(self, message: Message) -> Message:
        return serving_message(
            message, keeps_content_parts=self.keeps_content_parts, string_arguments=self.string_arguments
        )


def render_plan(renderer: Renderer, kind: str = "client") -> dict[str, Any]:
    """The manifest's ``plan.render``: which renderer made the prompts, and the date a date-dependent
    template was pinned to (``None`` when the template does not read the date)."""
    day = renderer.render_date if renderer.traits.date_dependent else None
    return {"renderer": kind, "date": day.isoformat() if day is not None else None}


def renderer_for_plan(tokenizer: Any, plan: Mapping[str, Any]) -> Renderer:
    """A renderer that renders as the run did: its template kwargs and its pinned date (resume, verify)."""
    render = plan.get("render") or {}
    return Renderer(
        tokenizer, plan.get("chat_template_kwargs") or {}, render_date=parse_render_date(render.get("date"))
    )


def count_rows_with_tools(prompts: Path | PromptSource) -> int:
    """Rows whose ``tools`` list is not empty (rows that mention ``"tools"`` are parsed; bad rows are not counted)."""
    from eagle_datagen.inputs.sources import open_source

    source = open_source(prompts) if isinstance(prompts, Path) else prompts
    count = 0
    for _, _, raw in source.rows():
        if b'"tools"' not in raw:
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("tools"), list) and obj["tools"]:
            count += 1
    return count


def template_notes(renderer: Renderer, prompts: Path | PromptSource) -> list[str]:
    """Warnings about the template, printed at start: dropped tools (with the rows affected), string arguments."""
    notes = []
    if renderer.traits.date_dependent:
        pinned = renderer.render_date.isoformat() if renderer.render_date else "today's date (not pinned)"
        notes.append(
            f"the chat template prints the date: prompts render with {pinned}, pinned in the manifest "
            "(resume and verify-shard render with it; --render-date YYYY-MM-DD sets it at run)"
        )
    if renderer.traits.drops_tools:
        affected = count_rows_with_tools(prompts)
        if affected:
            notes.append(
                f"warning: the chat template ignores `tools`: {affected:,} row(s) of the prompts have tools, and their "
                "prompts carry no tool schema (the model sees none either when served; DeepSeek R1/V3.1 templates "
                "do this). Describe the tools in a system message if the model should know them"
            )
    if renderer.traits.needs_string_arguments:
        notes.append(
            "warning: the chat template needs tool-call arguments as JSON strings (objects make it fail); arguments "
            "given as objects are serialized for it. SGLang's chat path parses them into objects, so served "
            "requests with tool-call history fail on this template"
        )
    return notes


def _describe(exc: BaseException) -> str:
    """The template's own message; the exception's type too when it is not a template error."""
    name = type(exc).__name__
    return f": {exc}" if name in ("TemplateError", "TemplateSyntaxError") else f" {name}: {exc}"


#: What rendering one row gives: its ``prompt_ids``, or why the row cannot be used.
Rendered = list[int] | BadInputError


class RowRenderer(Protocol):
    """Anything that renders rows as :meth:`Renderer.render_many` does (the client, the server, both)."""

    def render_many(self, rows: Sequence[PromptRow], path: str = ...) -> list[Rendered]: ...


def as_token_ids(result: Any) -> list[int]:
    """Normalizes what ``apply_chat_template(tokenize=True)`` returns across transformers versions."""
    if isinstance(result, Mapping) or hasattr(result, "keys"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if isinstance(result, Sequence) and result and isinstance(result[0], Sequence):
        if len(result) != 1:
            raise ValueError(f"expected one rendered conversation, got {len(result)}")
        result = result[0]
    return [int(token) for token in result]


def as_batch_token_ids(result: Any, n: int) -> list[list[int]]:
    """Normalizes a batched ``apply_chat_template(tokenize=True)`` result into ``n`` lists of ids."""
    if isinstance(result, Mapping) or hasattr(result, "keys"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if not isinstance(result, Sequence) or len(result) != n:
        raise ValueError(f"expected {n} rendered conversations")
    batch = []
    for ids in result:
        if not isinstance(ids, Sequence):
            raise ValueError("expected a list of ids per conversation")
        batch.append([int(token) for token in ids])
    return batch


class RenderPool:
    """Renders chunks of rows in worker processes, in order, for tokenizers too slow for one core.

    Each worker loads the tokenizer from ``tokenizer_path`` (the same files the manifest pins) and
    renders with the same chat-template kwargs as ``local``. Workers are started with ``spawn`` (the
    caller has threads running; forking them is unsafe) and ignore SIGINT: a Ctrl-C goes to the whole
    foreground process group, and the parent owns shutdown. Until one of them has loaded the
    tokenizer, chunks render in-process with ``local`` so the first request does not wait for the
    pool. At most ``ahead`` chunks are in flight, so memory stays bounded.

    A worker that dies (the OOM killer, a crash in a tokenizer's native code) breaks the pool: a new
    pool replaces it (up to ``max_replacements`` times, then rendering goes on in-process), the chunks
    that were in flight are rendered again, and one warning line says so. :meth:`close` stops the
    workers.
    """

    def __init__(
        self,
        local: Renderer,
        tokenizer_path: str | Path,
        *,
        workers: int,
        trust_remote_code: bool = False,
        ahead: int | None = None,
        max_replacements: int = 3,
    ) -> None:
        if workers < 1:
            raise UsageError("--render-workers must be at least 1")
        self.local = local
        self.workers = workers
        self.ahead = ahead or 2 * workers
        self.max_replacements = max_replacements
        self.replacements = 0
        self._initargs = (str(tokenizer_path), trust_remote_code, local.template_kwargs, local.render_date)
        self._pings: list[Future[bool]] = []
        self._executor: ProcessPoolExecutor | None = self._start()

    def _start(self) -> ProcessPoolExecutor:
        executor = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=self._initargs,
        )
        self._pings = [executor.submit(_worker_ping) for _ in range(self.workers)]
        return executor

    def _replace(self, exc: BaseException) -> None:
        """The pool broke (a worker died): start a new one, or render in-process from now on."""
        old, self._executor = self._executor, None
        if old is not None:
            old.shutdown(wait=False, cancel_futures=True)
        self.replacements += 1
        if self.replacements <= self.max_replacements:
            log.warning(
                "a render worker died (%s); starting new render workers (%d of %d)",
                exc or type(exc).__name__, self.replacements, self.max_replacements,
            )  # fmt: skip
            self._executor = self._start()
        else:
            log.warning(
                "a render worker died again (%s); rendering in-process from here (slower)", exc or type(exc).__name__
            )

    @property
    def in_process(self) -> bool:
        """True once rendering fell back to this process for good."""
        return self._executor is None

    def ready(self) -> bool:
        """True once a worker has loaded the tokenizer (False while they start, or after a fallback)."""
        if self._executor is None:
            return False
        done = [p for p in self._pings if p.done()]
        for ping in done:
            exc = ping.exception()
            if isinstance(exc, BrokenProcessPool):
                self._replace(exc)
                return False
            if exc is not None:
                raise UsageError(f"a render worker could not load the tokenizer: {exc}") from exc
        return bool(done)

    def render_chunks(self, chunks: Iterable[Sequence[PromptRow]], path: str = "<prompts>") -> Iterator[list[Rendered]]:
        """Like :meth:`Renderer.render_chunks`, the chunks spread over the workers (always in order)."""
        pending: deque[_Pending] = deque()
        for chunk in chunks:
            rows = list(chunk)
            if self._executor is None or (not pending and not self.ready()):
                while pending:
                    yield self._result(pending, path)
                yield self.local.render_many(rows, path)
                continue
            pending.append(self._submit(rows, path))
            while pending and (len(pending) >= self.ahead or _done(pending[0])):
                yield self._result(pending, path)
        while pending:
            yield self._result(pending, path)

    def _submit(self, rows: list[PromptRow], path: str) -> _Pending:
        """The chunk handed to the current pool (``future`` is ``None`` when it is to render in-process)."""
        while (executor := self._executor) is not None:
            try:
                return _Pending(rows, executor.submit(_worker_render, rows, path), executor)
            except BrokenProcessPool as exc:
                self._replace(exc)
        return _Pending(rows, None, None)

    def _result(self, pending: deque[_Pending], path: str) -> list[Rendered]:
        entry = pending.popleft()
        if entry.future is not None:
            try:
                return _unpack(entry.future.result(), path)
            except BrokenProcessPool as exc:
                if entry.executor is self._executor:  # not yet replaced (one death, one replacement)
                    self._replace(exc)
                for i, later in enumerate(pending):  # those sent to a broken pool go to the current one
                    if later.executor is not self._executor:
                        pending[i] = self._submit(later.rows, path)
        return self.local.render_many(entry.rows, path)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RenderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Pending:
    """A chunk handed to the workers; ``future`` is ``None`` when it is to render in-process."""

    rows: list[PromptRow]
    future: Future[list[_WorkerResult]] | None
    executor: ProcessPoolExecutor | None


def _done(entry: _Pending) -> bool:
    return entry.future is None or entry.future.done()


#: A worker's answer for one row: ids, or (line, kind, detail, fix) of a BadInputError (which does not pickle).
_WorkerResult = list[int] | tuple[int, str, str, str]
_worker_renderer: Renderer | None = None


def _worker_init(
    tokenizer_path: str,
    trust_remote_code: bool,
    template_kwargs: dict[str, Any],
    render_date: datetime.date | None = None,
) -> None:
    global _worker_renderer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent owns shutdown
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    _worker_renderer = Renderer(tokenizer, template_kwargs, render_date=render_date)


def _worker_ping() -> bool:
    return _worker_renderer is not None


def _worker_render(rows: list[PromptRow], path: str) -> list[_WorkerResult]:
    assert _worker_renderer is not None
    return [
        (r.line, r.kind, r.detail, r.fix) if isinstance(r, BadInputError) else r
        for r in _worker_renderer.render_many(rows, path)
    ]


def _unpack(results: list[_WorkerResult], path: str) -> list[Rendered]:
    return [BadInputError(path, *r) if isinstance(r, tuple) else r for r in results]
