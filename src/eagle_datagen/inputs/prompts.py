"""Prompt rows: stream a JSONL file, validate each row, give it a stable key.

Three row shapes are accepted (one JSON object per line):

* OpenAI style: ``{"id": ..., "messages": [{"role": ..., "content": ...}, ...], "tools": [...]}``
* ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}``
  (items written as ``{"role", "content"}`` are accepted too, as SpecForge writes them)
* A single user turn: ``{"id": ..., "prompt": "..."}``

Trailing assistant turns are dropped: the model regenerates the last assistant reply. A row's key is
its ``id`` (string or int); without one, a hash of the normalized conversation, so identical rows
collapse to one. Every problem is a :class:`BadInputError` naming the file, the line and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.partition import Partition
from eagle_datagen.inputs.sources import Columns, open_source
from eagle_datagen.record.turns import TurnPlan, plan_turns

Message = dict[str, Any]

ROLES = frozenset({"system", "user", "assistant", "tool"})
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
_ID_PREFIX = re.compile(rb'"id"\s*:')
SKIP_FIX = "fix the row, or pass --skip-bad-lines to set such rows aside in rejects.jsonl"


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One usable conversation, ready to render."""

    key: str
    line: int
    messages: list[Message]
    tools: list[Any] | None = None
    #: chat-template kwargs over the renderer's own (a mix's variant; ``None``: the run's kwargs only)
    template_kwargs: dict[str, Any] | None = None
    #: ``--turns all``: the row split at its assistant turns, by the reader that validated it
    turn_plan: TurnPlan | None = None


@dataclass(slots=True)
class ReadStats:
    """What the reader saw, for the end-of-run summary."""

    lines: int = 0
    rows: int = 0
    bad: int = 0
    collapsed_duplicates: int = 0
    done_skipped: int = 0
    #: Valid rows left to the other partitions of a ``--partition I/N`` run.
    other_partition: int = 0


@dataclass
class PromptReader:
    """Streams ``path`` (any source :mod:`.sources` reads) and yields :class:`PromptRow` objects, never
    loading it whole.

    ``on_bad`` receives each bad row when rows are to be set aside; without it the first bad row
    raises :class:`BadInputError`. With ``partition``, every row is still validated (so each job of a
    partitioned run reports the same bad rows, and duplicate ids are found across the whole input) but only
    the partition's rows are yielded.
    """

    path: Path
    on_bad: Callable[[BadInputError], None] | None = None
    #: Resume's fast path: a row whose explicit ``id`` is already done is not validated again (the
    #: prompts file is pinned by sha256, so it passed the first time) and not yielded.
    is_done: Callable[[str], bool] | None = None
    columns: Columns = field(default_factory=Columns)
    partition: Partition | None = None
    #: ``--turns all``: each row must also split into turns (:func:`eagle_datagen.record.turns.plan_turns`)
    turns: bool = False
    stats: ReadStats = field(default_factory=ReadStats)
    _seen: dict[str, tuple[int, bool]] = field(default_factory=dict, repr=False)

    def __iter__(self) -> Iterator[PromptRow]:
        name = str(self.path)
        for file, line_no, raw in open_source(self.path, self.columns).rows():
            self.stats.lines += 1
            if not raw.strip():
                continue
            if self.is_done is not None and self._skip_done(raw, line_no):
                continue
            try:
                row = parse_row(raw, file, line_no)
                if self.turns:
                    row = dataclasses.replace(row, turn_plan=plan_turns(row.messages, file, line_no))
                if not self._is_new(row):
                    continue
            except BadInputError as exc:
                self.stats.bad += 1
                if self.on_bad is None:
                    raise
                self.on_bad(exc)
                continue
            if self.partition is not None and not self.partition.owns(row.key):
                self.stats.other_partition += 1
                continue
            self.stats.rows += 1
            yield row
        if self.stats.rows == 0 and self.stats.bad == 0 and self.stats.other_partition == 0:
            raise UsageError(f"{name}: the prompts file has no rows; give a JSONL file with one object per line")

    def _skip_done(self, raw: bytes, line_no: int) -> bool:
        assert self.is_done is not None
        match = _ID_PREFIX.search(raw[:256])
        if match is None:
            return False
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return False
        value = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return False
        key = str(value)
        if not self.is_done(key) or key in self._seen:
            return False
        self._seen[key] = (line_no, False)
        self.stats.rows += 1
        self.stats.done_skipped += 1
        return True

    def _is_new(self, row: PromptRow) -> bool:
        """Tracks keys: a repeated explicit id is an error, a repeated hashed row collapses."""
        hashed = row.key.startswith("h:")
        first = self._seen.get(row.key)
        if first is None:
            self._seen[row.key] = (row.line, hashed)
            return True
        if hashed:
            self.stats.collapsed_duplicates += 1
            return False
        raise BadInputError(
            str(self.path),
            row.line,
            "duplicate_id",
            f"id {row.key!r} already used on line {first[0]}",
            "give each row a unique id, or pass --skip-bad-lines to set the later rows aside",
        )


def parse_row(raw: bytes, path: str, line: int) -> PromptRow:
    """Parses one JSONL line into a :class:`PromptRow` or raises :class:`BadInputError`."""

    def bad(kind: str, detail: str, fix: str = SKIP_FIX) -> BadInputError:
        return BadInputError(path, line, kind, detail, fix)

    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad("invalid_utf8", f"the line is not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad("invalid_json", f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise bad("not_object", f"each line must be a JSON object, got {type(obj).__name__}")

    shapes = [name for name in ("messages", "conversations", "prompt") if name in obj]
    if not shapes:
        raise bad("no_conversation", "the row has none of 'messages', 'conversations' or 'prompt'")
    if len(shapes) > 1:
        raise bad("ambiguous_row", f"the row has {' and '.join(repr(s) for s in shapes)}; give exactly one")
    shape = shapes[0]
    if shape == "messages":
        messages = _openai_messages(obj["messages"], bad)
    elif shape == "conversations":
        messages = _sharegpt_messages(obj["conversations"], bad)
    else:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise bad("bad_prompt", "'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": prompt}]

    messages = _drop_trailing_assistant(messages)
    for i, message in enumerate(messages):
        if "tool_calls" in message:  # only turns that reach the template (dropped replies are not sent)
            _check_tool_calls(message["tool_calls"], f"{shape}[{i}]", message["role"], bad)
    if not any(m["role"] == "user" for m in messages):
        raise bad("no_user_turn", "no user turn is left once trailing assistant turns are dropped")

    tools = obj.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("bad_tools", "'tools' must be a list of objects (OpenAI tool schemas)")
    if tools == []:
        tools = None
    if tools is not None:
        _check_tools(tools, bad)

    key = _row_key(obj.get("id", None), messages, tools, bad)
    return PromptRow(key=key, line=line, messages=messages, tools=tools)


def _openai_messages(value: Any, bad: Callable[..., BadInputError]) -> list[Message]:
    if not isinstance(value, list):
        raise bad("bad_messages", "'messages' must be a list of {role, content} objects")
    if not value:
        raise bad("empty_conversation", "'messages' is empty")
    messages: list[Message] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad("bad_messages", f"messages[{i}] must be an object with 'role' and 'content'")
        role = item.get("role")
        if role not in ROLES:
            raise bad(
                "unknown_role",
                f"messages[{i}] has role {role!r}; expected one of system, user, assistant, tool",
            )
        message = {k: v for k, v in item.items() if v is not None}
        message["content"] = _content(item.get("content"), f"messages[{i}]", role, item, bad)
        messages.append(message)
    return messages


def _check_tool_calls(value: Any, where: str, role: str, bad: Callable[..., BadInputError]) -> None:
    """Assistant ``tool_calls`` as SGLang's chat path takes them: a list of ``{"type": "function", "function":
    {"name", "arguments"}}``, the arguments a JSON object or a string holding one (the path parses strings with
    orjson, strictly: ``normalize_assistant_tool_call_arguments`` in ``serving_chat.py``)."""
    if role != "assistant":
        raise bad("bad_tool_call", f"{where} has 'tool_calls' but role {role!r}; only assistant turns make tool calls")
    if not isinstance(value, list):
        raise bad("bad_tool_call", f"{where}.tool_calls must be a list of tool calls")
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad("bad_tool_call", f'{at} must be an object with a "function": {{"name", "arguments"}} object')
        if call.get("type", "function") != "function":
            raise bad("bad_tool_call", f"{at}.type is {call.get('type')!r}; only 'function' tool calls exist")
        function = call["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad("bad_tool_call", f"{at}.function.name must be a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError as exc:
                raise bad(
                    "bad_tool_arguments",
                    f"{at}.function.arguments is a string but not valid JSON ({exc}); "
                    "SGLang's chat path parses it and refuses the request",
                ) from None
            if not isinstance(arguments, dict):
                raise bad(
                    "bad_tool_arguments",
                    f"{at}.function.arguments holds JSON {type(arguments).__name__}, not an object; "
                    "SGLang's chat path refuses it",
                )
        elif arguments is not None and not isinstance(arguments, dict):
            raise bad(
                "bad_tool_arguments",
                f"{at}.function.arguments must be a JSON object or a string holding one, "
                f"got {type(arguments).__name__}",
            )


def _check_tools(tools: list[Any], bad: Callable[..., BadInputError]) -> None:
    """Tool schemas as SGLang's ``Tool`` model takes them: ``{"type": "function", "function": {"name", ...}}``."""
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(
                "bad_tools",
                f'tools[{i}] has no "function" object with a "name"; wrap a bare schema as '
                '{"type": "function", "function": {"name": ..., "parameters": ...}}',
            )
        if not isinstance(tool.get("type", "function"), str):
            raise bad("bad_tools", f"tools[{i}].type must be a string ('function')")


def _sharegpt_messages(value: Any, bad: Callable[..., BadInputError]) -> list[Message]:
    if not isinstance(value, list):
        raise bad("bad_messages", "'conversations' must be a list of {from, value} objects")
    if not value:
        raise bad("empty_conversation", "'conversations' is empty")
    messages: list[Message] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad("bad_messages", f"conversations[{i}] must be an object with 'from' and 'value'")
        if "from" in item:
            speaker, content = item.get("from"), item.get("value")
        else:
            speaker, content = item.get("role"), item.get("content")
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise bad(
                "unknown_role",
                f"conversations[{i}] has 'from' {speaker!r}; expected one of system, human, gpt",
            )
        messages.append({"role": role, "content": _content(content, f"conversations[{i}]", role, item, bad)})
    return messages


def _content(value: Any, where: str, role: str, item: dict[str, Any], bad: Callable[..., BadInputError]) -> Any:
    """A string, or a list of text parts; images and other media are refused."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant" and item.get("tool_calls"):
        return ""
    if isinstance(value, list):
        for j, part in enumerate(value):
            if isinstance(part, str):
                continue
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(
                    "non_text_content",
                    f"{where}.content[{j}] is {kind!r}; only text parts are supported",
                )
            if not isinstance(part.get("text"), str):
                raise bad("non_text_content", f"{where}.content[{j}] has no string 'text'")
        return [p if isinstance(p, dict) else {"type": "text", "text": p} for p in value]
    raise bad("bad_content", f"{where}.content must be a string or a list of text parts")


def _drop_trailing_assistant(messages: list[Message]) -> list[Message]:
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def _row_key(value: Any, messages: list[Message], tools: list[Any] | None, bad: Callable[..., BadInputError]) -> str:
    if value is None:
        canonical = orjson.dumps({"messages": messages, "tools": tools}, option=orjson.OPT_SORT_KEYS)
        return "h:" + hashlib.blake2b(canonical, digest_size=10).hexdigest()
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise bad("bad_id", f"'id' must be a string or an integer, got {type(value).__name__}")
    key = str(value)
    if not key or key.startswith("h:") or any(c in key for c in "\n\r\t"):
        raise bad(
            "bad_id",
            f"'id' {key!r} is empty, starts with 'h:' (reserved for hashed rows), or has a control character",
        )
    return key
