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

import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.prompts import SKIP_FIX, Message, PromptRow

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
# SGLang's serving path keeps a list of content parts only for templates that loop over them
# (``process_content_for_template_format``); otherwise the text parts are joined with a space.
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+(?:message|msg|m)\s*(?:\.content|\[\s*['\"]content['\"]\s*\])")


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


class Renderer:
    """Renders prompt rows with one tokenizer and one set of chat-template kwargs."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.keeps_content_parts = bool(_CONTENT_LOOP.search(template))

    def render(self, row: PromptRow, path: str = "<prompts>") -> list[int]:
        """``prompt_ids`` for ``row``; a template error becomes a :class:`BadInputError`."""
        messages = [self._template_message(m) for m in row.messages]
        try:
            result = self.tokenizer.apply_chat_template(
                messages,
                tools=row.tools,
                add_generation_prompt=True,
                tokenize=True,
                **self.kwargs_for(row),
            )
        except Exception as exc:
            raise BadInputError(path, row.line, "template_error", f"the chat template raised: {exc}", SKIP_FIX) from exc
        return as_token_ids(result)

    def kwargs_for(self, row: PromptRow) -> dict[str, Any]:
        """The template kwargs of one row: the renderer's, with the row's own (a mix's variant) over them."""
        return {**self.template_kwargs, **row.template_kwargs} if row.template_kwargs else self.template_kwargs

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
                result = self.tokenizer.apply_chat_template(
                    [[self._template_message(m) for m in row.messages] for row in rows],
                    tools=rows[0].tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    **self.kwargs_for(rows[0]),
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
        content = message.get("content")
        if isinstance(content, list) and not self.keeps_content_parts:
            return {**message, "content": " ".join(part["text"] for part in content)}
        return message


#: What rendering one row gives: its ``prompt_ids``, or why the row cannot be used.
Rendered = list[int] | BadInputError


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
        self._initargs = (str(tokenizer_path), trust_remote_code, local.template_kwargs)
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


def _worker_init(tokenizer_path: str, trust_remote_code: bool, template_kwargs: dict[str, Any]) -> None:
    global _worker_renderer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent owns shutdown
    _worker_renderer = Renderer(load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code), template_kwargs)


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
