"""The turn loop of ``--turns all``: after each generated turn, its reply as the next turn's history.

A conversation is one work item of the pipeline that lives for all its turns (turns of one conversation are
sequential, conversations run side by side, so the servers stay full). After turn ``k`` comes back:

1. its output ids are decoded (special tokens kept, the matched stop token left out, the prompt-side reasoning
   opener put in front) and split by the server's own parsers (``POST /separate_reasoning``,
   ``POST /parse_function_call``: :mod:`eagle_datagen.server.parsers`) into the assistant message serving keeps;
2. :func:`eagle_datagen.record.turns.next_step` says how the conversation goes on (the source's next user or
   tool turns) or why it ends;
3. the next turn's conversation is rendered by the run's own renderer, and checked against the server's limits.

Only then is turn ``k``'s record written, holding the messages it was rendered from, its parsed ``reply`` and
its ``end`` (``null`` while the conversation goes on), so each record is checkable alone and ``resume`` continues
a conversation from its last record without generating any turn twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from eagle_datagen.errors import BadInputError, ServerError
from eagle_datagen.generate.limits import Limits
from eagle_datagen.inputs.prompts import PromptRow
from eagle_datagen.record.family import Family, expectation
from eagle_datagen.record.turns import (
    END_RENDER_ERROR,
    END_TOO_LONG,
    Message,
    TurnConfig,
    TurnPlan,
    count_calls,
    first_messages,
    next_step,
    split_turn_id,
    turn_id,
)
from eagle_datagen.server.parsers import Poster, parse_reply, reply_text

#: The tool the parser probe declares (any schema does: the probe text calls none).
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}},
}
#: Renders one row (its ``messages`` replaced by a turn's conversation) to ``prompt_ids``, or raises
#: :class:`BadInputError`. Called in a worker thread.
RenderOne = Callable[[PromptRow], list[int]]


@dataclass(slots=True)
class Conversation:
    """Where one conversation (one sample of one row) stands: the turn about to be sent, and its messages."""

    #: the source row (its ``turn_plan`` set by the reader), with a mix's kwargs
    row: PromptRow
    base_id: str
    turn: int
    messages: list[Message]

    @property
    def plan(self) -> TurnPlan:
        assert self.row.turn_plan is not None
        return self.row.turn_plan

    @property
    def record_id(self) -> str:
        return turn_id(self.base_id, self.turn)

    def fields(self) -> dict[str, Any]:
        """The record fields of the turn about to be sent."""
        return {"conversation": self.row.key, "turn": self.turn}


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What turn ``k`` of a conversation led to: its parsed reply, and the next turn or the end."""

    reply: Message
    end: str | None
    detail: str = ""
    next_messages: list[Message] | None = None
    next_prompt_ids: list[int] | None = None


def opener_text(tokenizer: Any, family: Family, prompt_ids: Sequence[int]) -> str:
    """The reasoning opener the prompt's tail holds (``<think>``, ``<think>\\n``), which the output then lacks: the
    parsers look for it in the text they get."""
    if family.think_open is None or expectation(family, prompt_ids) != "inside":
        return ""
    tail = list(prompt_ids[-16:])
    at = len(tail) - 1 - tail[::-1].index(family.think_open)
    text: str = tokenizer.decode(tail[at:], skip_special_tokens=False)
    return text


async def parse_turn(
    http: httpx.AsyncClient | Poster,
    url: str,
    config: TurnConfig,
    *,
    tokenizer: Any,
    family: Family,
    stop_ids: Sequence[int],
    record_id: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    tools: Sequence[dict[str, Any]] | None,
    messages: Sequence[Message],
) -> Message:
    """One turn's output as the assistant message serving keeps: decoded (special tokens kept, the stop token left
    out, the prompt's reasoning opener in front) and split by the server's parsers. Tool-call ids follow the
    parser's serving rule, else ``call_{record id}_{index}``. The client and ``verify-shard --server-url`` both call
    this. Raises :class:`ServerError`."""
    text = await asyncio.to_thread(
        reply_text, tokenizer, output_ids, stop_ids, opened_by_prompt=opener_text(tokenizer, family, prompt_ids)
    )
    parsed = await parse_reply(
        http,
        url,
        text,
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
        tools=tools,
        call_id=lambda index: f"call_{record_id}_{index}",
        earlier_calls=count_calls(messages),
    )
    return parsed.message()


class TurnDriver:
    """Parses each reply with the server's parsers and renders the next turn (shared by every conversation)."""

    def __init__(
        self,
        config: TurnConfig,
        *,
        tokenizer: Any,
        family: Family,
        stop_ids: Sequence[int],
        render_one: RenderOne,
        http: httpx.AsyncClient | Poster,
        limits: Limits,
        parser_url: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.family = family
        self.stop_ids = list(stop_ids)
        self.render_one = render_one
        self.http = http
        self.limits = limits
        #: A router's URL → a worker's, for the parser endpoints a router may not pass on.
        self.parser_url = dict(parser_url or {})

    async def parse(
        self, url: str, conversation: Conversation, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> Message:
        """The reply as serving keeps it (:func:`parse_turn`; raises :class:`ServerError`)."""
        return await parse_turn(
            self.http,
            self.parser_url.get(url, url),
            self.config,
            tokenizer=self.tokenizer,
            family=self.family,
            stop_ids=self.stop_ids,
            record_id=conversation.record_id,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            tools=conversation.row.tools,
            messages=conversation.messages,
        )

    async def advance(self, conversation: Conversation, reply: Message, finish_type: str) -> TurnResult:
        """The step after this turn (:func:`next_step`) and, when the conversation goes on, the next prompt."""
        step = next_step(
            conversation.plan,
            conversation.turn,
            conversation.messages,
            reply,
            finish_type,
            on_truncated=self.config.on_truncated,
        )
        if step.messages is None:
            return TurnResult(reply, step.end, step.detail)
        row = dataclasses.replace(conversation.row, messages=step.messages)
        try:
            prompt_ids = await asyncio.to_thread(self.render_one, row)
        except BadInputError as exc:
            return TurnResult(reply, END_RENDER_ERROR, f"turn {conversation.turn + 1}: {exc.detail}")
        problem = self.limits.problem(prompt_ids)  # too long, or ids beyond the vocabulary: it cannot be sent
        if problem is not None:
            return TurnResult(reply, END_TOO_LONG, f"turn {conversation.turn + 1}: {problem[1]}")
        return TurnResult(reply, None, "", step.messages, prompt_ids)

    async def check_parsers(self, url: str) -> None:
        """One parse of a probe text before any request, so a wrong parser name stops the run at once."""
        try:
            await parse_reply(
                self.http,
                self.parser_url.get(url, url),
                "hello",
                reasoning_parser=self.config.reasoning_parser,
                tool_call_parser=self.config.tool_call_parser,
                tools=[PROBE_TOOL],
                call_id=lambda index: f"probe_{index}",
            )
        except ServerError as exc:
            raise ServerError(
                f"--turns all: the server's parsers refused the probe ({exc}); give the SGLang parser names with "
                "--reasoning-parser-name / --tool-call-parser-name (or [parsers] in the preset)"
            ) from exc


@dataclass
class TurnState:
    """What earlier runs left of each conversation (``base`` id: ``KEY``, or ``KEY#i`` with samples), for resume.

    A conversation is ended when ``conversations.jsonl`` says so; otherwise it goes on from the turn after its
    last durable record (none: from turn 1). The last records of conversations that go on are read back from the
    shards (they are few: the ones in flight at a stop)."""

    last_turn: dict[str, int] = dataclasses.field(default_factory=dict)
    ended: dict[str, str] = dataclasses.field(default_factory=dict)
    records: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: turn ids whose failure is kept aside (``--no-retry-failed``): their conversation goes no further
    kept_aside: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def load(
        cls,
        done: Iterable[str],
        ends: Iterable[Mapping[str, Any]],
        read: Callable[[set[str]], dict[str, dict[str, Any]]],
        *,
        kept_aside: Iterable[str] = (),
    ) -> TurnState:
        """``done``: the durable record ids; ``ends``: the entries of ``conversations.jsonl``; ``read``: reads
        records back by id (:func:`eagle_datagen.store.shards.read_records`)."""
        state = cls(kept_aside=set(kept_aside))
        for rid in done:
            split = split_turn_id(rid)
            if split is not None and split[1] > state.last_turn.get(split[0], 0):
                state.last_turn[split[0]] = split[1]
        for entry in ends:
            base, end = entry.get("base"), entry.get("end")
            if isinstance(base, str) and isinstance(end, str):
                state.ended[base] = end
        going_on = {turn_id(b, k): b for b, k in state.last_turn.items() if b not in state.ended}
        for rid, record in read(set(going_on)).items():
            state.records[going_on[rid]] = record
        return state

    def unreadable(self) -> list[str]:
        """Conversations whose last durable turn could not be read back from the shards (they are not continued:
        that would write a turn twice; ``verify-shard`` shows what is wrong with the shard)."""
        return sorted(b for b, k in self.last_turn.items() if k and b not in self.ended and b not in self.records)

    def found_ended(self) -> list[dict[str, Any]]:
        """Ends that records show but ``conversations.jsonl`` lacks (a stop between the two writes): their
        entries, to append; they count as ended from now on."""
        entries = []
        for base, record in self.records.items():
            end = record.get("end")
            if isinstance(end, str):
                self.ended[base] = end
                entries.append(
                    end_entry(
                        base, str(record.get("id")), record.get("conversation"), record.get("sample"),
                        record.get("turn"), end, str(record.get("end_detail") or ""),
                    )
                )  # fmt: skip
        for base in self.ended:
            self.records.pop(base, None)
        return entries

    def is_done(self, base: str) -> bool:
        return base in self.ended or turn_id(base, self.last_turn.get(base, 0) + 1) in self.kept_aside

    def start(self, row: PromptRow, base: str, on_truncated: str) -> Conversation | None:
        """The conversation of ``base`` (a sample of ``row``, split by the reader) from where it stands, or ``None``
        when it has nothing left to send."""
        assert row.turn_plan is not None
        plan = row.turn_plan
        if self.is_done(base):
            return None
        record = self.records.get(base)
        if record is None:
            if self.last_turn.get(base, 0):  # its record could not be read back: do not write a turn twice
                return None
            return Conversation(row, base, 1, first_messages(plan))
        turn = self.last_turn[base]
        finish = record.get("finish_reason") or {}
        step = next_step(
            plan, turn, record.get("messages") or [], record.get("reply") or {}, str(finish.get("type")),
            on_truncated=on_truncated,
        )  # fmt: skip
        if step.messages is None:
            return None
        return Conversation(row, base, turn + 1, step.messages)

    def remaining(self, plan: TurnPlan, base: str) -> int:
        """Turns still to send for ``base`` at most (the progress bar's total)."""
        return 0 if self.is_done(base) else max(0, plan.turns - self.last_turn.get(base, 0))


def end_entry(
    base: str, record_id: str, conversation: Any, sample: Any, turns: Any, end: str, detail: str
) -> dict[str, Any]:
    """The ``conversations.jsonl`` line of the conversation ``base`` whose last record is ``record_id``."""
    entry = {"base": base, "conversation": conversation, "sample": sample, "turns": turns, "id": record_id, "end": end}
    return {**entry, "detail": detail} if detail else entry
