"""``verify-shard`` for ``--turns all`` records: each turn against its source row and the turn before it.

Per record (in batches, like the prompt re-render):

* ``prompt_ids`` is a fresh render of the record's own ``messages`` (with its row's tools and the record's
  template kwargs), so each record is checkable alone;
* turn 1's ``messages`` are the source row's conversation up to its first assistant turn;
* :func:`eagle_datagen.record.turns.next_step` (the rule the client ran) is applied to the record's
  ``messages`` and its parsed ``reply``: the ``end`` it gives must be the record's, and the conversation it
  gives must be, exactly, the next turn record's ``messages``.

At the end, per conversation: its turns run 1, 2, … with none missing, none after an end. Only digests of the
messages are kept between records, so memory stays small whatever the size of the data set.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from eagle_datagen.errors import BadInputError
from eagle_datagen.inputs.prompts import PromptRow
from eagle_datagen.inputs.render import RowRenderer
from eagle_datagen.record.turns import ENDS, RENDER_ENDS, first_messages, next_step, plan_turns, split_turn_id

BATCH = 256

#: ``(kind, path, line, id, message)``
Sink = Callable[[str, str, int, str, str], None]


def first_difference(stored: Sequence[int], rendered: Sequence[int]) -> int:
    """Where two id lists first differ (the shorter one's length when one is the other's prefix)."""
    at = next((i for i, (a, b) in enumerate(zip(stored, rendered, strict=False)) if a != b), None)
    return min(len(stored), len(rendered)) if at is None else at


def messages_digest(messages: Sequence[Any]) -> bytes:
    """A digest of a message list, independent of key order."""
    return hashlib.blake2b(orjson.dumps(list(messages), option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


@dataclass(slots=True)
class _Turn:
    path: str
    line: int
    rid: str
    #: digest of the record's ``messages``
    given: bytes
    #: digest of the conversation next_step makes of it (``None``: it ends the conversation)
    following: bytes | None
    ended: bool


@dataclass(slots=True)
class _Pending:
    path: str
    line: int
    rid: str
    key: str
    record: dict[str, Any]


class ReplyCheck:
    """``verify-shard --server-url``: each turn's output parsed again by that server's parsers (the client's own
    :func:`eagle_datagen.generate.turns.parse_turn`), which must give the recorded ``reply``."""

    def __init__(self, url: str, plan_turns_json: dict[str, Any], tokenizer: Any, family: Any, stop_ids: Sequence[int],
                 api_key: str | None) -> None:  # fmt: skip
        from eagle_datagen.record.turns import TurnConfig

        self.url = url
        self.config = TurnConfig(
            plan_turns_json.get("reasoning_parser"),
            plan_turns_json.get("tool_call_parser"),
            str(plan_turns_json.get("on_truncated_turn") or "stop"),
        )
        self.tokenizer = tokenizer
        self.family = family
        self.stop_ids = list(stop_ids)
        self.api_key = api_key

    def replies(self, work: list[tuple[str, dict[str, Any], list[dict[str, Any]] | None]]) -> list[Any]:
        """``(record id, record, row tools)`` → the parsed reply of each (or the :class:`ServerError`)."""
        import asyncio

        from eagle_datagen.generate.client import make_http_client
        from eagle_datagen.generate.connect import ssl_context
        from eagle_datagen.generate.turns import parse_turn

        async def all_of() -> list[Any]:
            # the run's own client: one trust store, its auth header, no proxies (as verify's server renderer)
            client = make_http_client(
                max_connections=16, request_timeout_s=120.0, api_key=self.api_key, tls=ssl_context()
            )
            async with client as http:
                semaphore = asyncio.Semaphore(16)

                async def one(rid: str, record: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
                    async with semaphore:
                        return await parse_turn(
                            http, self.url, self.config, tokenizer=self.tokenizer, family=self.family,
                            stop_ids=self.stop_ids, record_id=rid, prompt_ids=record["prompt_ids"],
                            output_ids=record["output_ids"], tools=tools, messages=record["messages"],
                        )  # fmt: skip

                return await asyncio.gather(*(one(*w) for w in work), return_exceptions=True)

        return asyncio.run(all_of())


class TurnChecker:
    """Checks turn records against their source rows (``index``: verify's :class:`PromptIndex`)."""

    def __init__(
        self,
        renderer: RowRenderer | None,
        index: Any,
        *,
        on_truncated: str,
        error: Sink,
        warn: Sink,
        reply_check: ReplyCheck | None = None,
    ) -> None:
        self.reply_check = reply_check
        self.renderer = renderer
        self.index = index
        self.on_truncated = on_truncated
        self.error = error
        self.warn = warn
        self.pending: list[_Pending] = []
        self.turns: dict[str, dict[int, _Turn]] = {}

    def add(self, path: str, line: int, rid: str, key: str, record: dict[str, Any]) -> None:
        problem = _schema_problem(record)
        if problem is not None:
            self.error("schema", path, line, rid, problem)
            return
        self.pending.append(_Pending(path, line, rid, key, record))
        if len(self.pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        rows = self._rows({p.key for p in self.pending})
        to_render: list[tuple[_Pending, PromptRow]] = []
        for pending in self.pending:
            row = rows[pending.key]
            if isinstance(row, str):
                self.error("prompt_row_missing", pending.path, pending.line, pending.rid, row)
                continue
            turn_row = self._check(pending, row)
            if turn_row is not None:
                to_render.append((pending, turn_row))
        if self.renderer is not None and to_render:
            rendered = self.renderer.render_many([row for _, row in to_render], str(self.index.path))
            for (pending, _), ids in zip(to_render, rendered, strict=True):
                self._compare(pending, ids)
        if self.reply_check is not None and to_render:
            work = [(p.rid, p.record, row.tools) for p, row in to_render]
            for (pending, _), reply in zip(to_render, self.reply_check.replies(work), strict=True):
                where = (pending.path, pending.line, pending.rid)
                if isinstance(reply, Exception):
                    self.error("reply_unchecked", *where, f"the server's parsers did not answer: {reply}")
                elif reply != pending.record["reply"]:
                    self.error(
                        "reply_mismatch", *where,
                        f"the server's parsers split output_ids as {_short(reply)}, not as the recorded reply",
                    )  # fmt: skip
        self.pending.clear()

    def _rows(self, keys: set[str]) -> dict[str, PromptRow | str]:
        found = self.index.read(keys)  # verify's PromptIndex: the rows, or why one no longer parses
        return {key: found.get(key, f"no row with key {key!r} in {self.index.path}") for key in keys}

    def _check(self, pending: _Pending, row: PromptRow) -> PromptRow | None:
        """The record against its row and the rule; the row to render its prompt from (``None``: not rendered)."""
        record, where = pending.record, (pending.path, pending.line, pending.rid)
        base_turn = split_turn_id(pending.rid)
        if base_turn is None or base_turn[1] != record["turn"]:
            self.error("id_mismatch", *where, f"a turn record's id must end in @t{record['turn']}")
            return None
        base, turn = base_turn
        if record["conversation"] != pending.key:
            self.error("id_mismatch", *where, f"conversation {record['conversation']!r} is not its key {pending.key!r}")
        try:
            plan = plan_turns(row.messages, str(self.index.path), row.line)
        except BadInputError as exc:
            self.error("turn_history", *where, f"its source row does not split into turns: {exc.detail}")
            return None
        messages, reply, end = record["messages"], record["reply"], record["end"]
        given = messages_digest(messages)
        if turn == 1 and given != messages_digest(first_messages(plan)):
            self.error(
                "turn_history", *where, f"turn 1's messages are not the source row's (line {row.line}) first turn"
            )
        if turn > plan.turns:
            self.error("turn_history", *where, f"turn {turn} of a conversation with {plan.turns} assistant turns")
            return None
        finish = str((record.get("finish_reason") or {}).get("type"))
        step = next_step(plan, turn, messages, reply, finish, on_truncated=self.on_truncated)
        if step.messages is None:
            if end != step.end:
                self.error("turn_end", *where, f"end is {end!r}; this turn ends the conversation as {step.end!r}")
        elif end is not None and end not in RENDER_ENDS:
            self.error("turn_end", *where, f"end is {end!r}, but the conversation goes on after this turn")
        following = messages_digest(step.messages) if step.messages is not None and end is None else None
        by_turn = self.turns.setdefault(base, {})
        if turn in by_turn:
            return None  # a duplicate id: the record loop reports it
        by_turn[turn] = _Turn(pending.path, pending.line, pending.rid, given, following, end is not None)
        kwargs = record.get("chat_template_kwargs")
        return dataclasses.replace(
            row, messages=list(messages), template_kwargs=kwargs if isinstance(kwargs, dict) else None
        )

    def _compare(self, pending: _Pending, rendered: list[int] | BadInputError) -> None:
        where = (pending.path, pending.line, pending.rid)
        if isinstance(rendered, BadInputError):
            self.error("render_error", *where, f"its messages do not render: {rendered.detail}")
            return
        stored = pending.record["prompt_ids"]
        if rendered != stored:
            at = first_difference(stored, rendered)
            self.error(
                "prompt_mismatch",
                *where,
                f"prompt_ids differ from a fresh render of the record's messages at position {at} "
                f"({len(stored)} ids stored, {len(rendered)} rendered)",
            )

    def settle(self) -> None:
        """Per conversation: turns 1..n with none missing, each the successor the rule makes of the one before."""
        self.flush()
        for base, by_turn in self.turns.items():
            last = max(by_turn)
            for turn in range(1, last + 1):
                this = by_turn.get(turn)
                before = by_turn.get(turn - 1)
                if this is None:
                    after = by_turn[min(t for t in by_turn if t > turn)]
                    self.error("turn_missing", after.path, after.line, after.rid, f"turn {turn} of {base!r} is missing")
                    continue
                if before is None:
                    continue
                if before.ended:
                    self.error("turn_after_end", this.path, this.line, this.rid, f"turn {turn - 1} ended {base!r}")
                elif before.following != this.given:
                    self.error(
                        "turn_history",
                        this.path,
                        this.line,
                        this.rid,
                        f"its messages are not turn {turn - 1}'s messages + its parsed reply + the source's next "
                        f"turns ({before.path}:{before.line})",
                    )
            final = by_turn[last]
            if not final.ended:
                self.warn(
                    "conversation_open",
                    final.path,
                    final.line,
                    final.rid,
                    f"{base!r} has no end after turn {last}: `eagle-datagen resume` continues it",
                )
        self.turns.clear()


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 200 else text[:200] + "…"


def _schema_problem(record: dict[str, Any]) -> str | None:
    if type(record.get("conversation")) is not str:
        return "a turn record needs a string 'conversation'"
    turn = record.get("turn")
    if type(turn) is not int or turn < 1:
        return "'turn' must be an integer >= 1"
    messages = record.get("messages")
    if type(messages) is not list or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return "'messages' must be the list of messages the turn was rendered from"
    if type(record.get("reply")) is not dict:
        return "'reply' must be the turn's parsed assistant message"
    end = record.get("end", 0)
    if end is not None and end not in ENDS:
        return f"'end' must be null or one of {', '.join(sorted(ENDS))}, got {end!r}"
    return None
