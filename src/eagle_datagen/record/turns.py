"""Multi-turn regeneration (``--turns all``): a conversation split at its assistant turns, and the one rule that
says what each generated turn's successor is.

A source conversation ``[system, u1, a1, u2, a2, u3]`` has three assistant slots: turn 1 is generated from
``[system, u1]``; its parsed reply ``r1`` replaces ``a1``, so turn 2 is generated from ``[system, u1, r1, u2]``;
and so on. The source's assistant turns are never sent; the messages that follow each one (users, tool results)
are. Tool results are spliced only when the generated turn called the same functions, in order, as the source's
turn did (speculators' rule); otherwise the conversation ends there, with a reason. Tool results are never
invented.

:func:`next_step` is shared by the client (which decides, after each turn, whether and how the conversation goes
on) and by ``verify-shard`` (which recomputes that decision from the records), so the two cannot drift. It is
pure: messages in, messages out. The ids of a turn record are ``KEY@t{k}`` (``KEY#i@t{k}`` with samples).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from eagle_datagen.errors import BadInputError

Message = dict[str, Any]

TURNS_MODES = ("last", "all")
ON_TRUNCATED = ("stop", "continue")

#: Why a conversation ended. ``complete``: its last source turn was generated. The others end it early.
END_COMPLETE = "complete"
END_TRUNCATED = "truncated"  # the turn ended with ``length`` (``--on-truncated-turn stop``)
END_TOOL_CALL_MISSING = "tool_call_missing"  # the source's turn called tools, the generated one did not
END_TOOL_CALLS_DIFFER = "tool_calls_differ"  # other functions, or another count, than the source's results answer
END_TOOL_RESULTS_MISSING = "tool_results_missing"  # the generated turn called tools the source has no results for
END_BAD_TOOL_ARGUMENTS = "bad_tool_arguments"  # a call's arguments are no JSON object: serving refuses the history
END_TOO_LONG = "too_long"  # the next turn's prompt does not fit the server's max_req_input_len
END_RENDER_ERROR = "render_error"  # the chat template raised on the next turn's conversation
#: Ends that :func:`next_step` decides; the others come from rendering the next turn.
STEP_ENDS = frozenset(
    {END_COMPLETE, END_TRUNCATED, END_TOOL_CALL_MISSING, END_TOOL_CALLS_DIFFER, END_TOOL_RESULTS_MISSING,
     END_BAD_TOOL_ARGUMENTS}
)  # fmt: skip
RENDER_ENDS = frozenset({END_TOO_LONG, END_RENDER_ERROR})
ENDS = STEP_ENDS | RENDER_ENDS

_TURN_ID = re.compile(r"^(?P<base>.+)@t(?P<turn>[1-9][0-9]*)$")
TURN_FIX = "fix the row, or pass --skip-bad-lines to set such rows aside in rejects.jsonl"


def turn_id(base: str, turn: int) -> str:
    """The record id of turn ``turn`` (1-based) of the conversation whose id without turns is ``base``."""
    return f"{base}@t{turn}"


def split_turn_id(rid: str) -> tuple[str, int] | None:
    """``(base, turn)`` of a turn record id, or ``None`` for an id without a turn."""
    match = _TURN_ID.match(rid)
    return None if match is None else (match["base"], int(match["turn"]))


@dataclass(frozen=True)
class TurnConfig:
    """How ``--turns all`` builds history."""

    reasoning_parser: str | None
    tool_call_parser: str | None
    on_truncated: str = "stop"
    #: whether a name was given (``none`` is one: that parser is off on purpose), else it was left unset
    reasoning_parser_given: bool = True
    tool_call_parser_given: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": "all",
            "reasoning_parser": self.reasoning_parser,
            "tool_call_parser": self.tool_call_parser,
            "on_truncated_turn": self.on_truncated,
        }


@dataclass(frozen=True, slots=True)
class Segment:
    """One assistant turn of the source and the messages that follow it, up to the next assistant turn."""

    source: Message
    after: tuple[Message, ...]

    def results(self) -> list[Message]:
        """The tool results answering this turn: the ``tool`` messages right after it."""
        out: list[Message] = []
        for message in self.after:
            if message["role"] != "tool":
                break
            out.append(message)
        return out


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """A conversation split at its assistant turns: turn 1 is generated from ``prefix``."""

    prefix: tuple[Message, ...]
    segments: tuple[Segment, ...]

    @property
    def turns(self) -> int:
        """How many turns a run with ``--turns all`` generates at most (one per source assistant turn, plus the
        final one the trailing user or tool turn asks for)."""
        return len(self.segments) + 1


def plan_turns(messages: Sequence[Message], path: str, line: int) -> TurnPlan:
    """Splits a row's messages (trailing assistant turns already dropped) at its assistant turns, refusing a
    conversation that no template renders as serving would: no user turn before the first assistant one, a tool
    result with no call before it, a system turn after the start, two assistant turns in a row."""

    def bad(kind: str, detail: str) -> BadInputError:
        return BadInputError(path, line, kind, detail, TURN_FIX)

    prefix: list[Message] = []
    segments: list[Segment] = []
    current: Message | None = None
    after: list[Message] = []
    open_calls = 0  # tool calls of the last assistant turn not yet answered
    previous: str | None = None
    for i, message in enumerate(messages):
        role = message["role"]
        where = f"message {i} ({role})"
        if role == "system" and previous not in (None, "system"):
            raise bad("roles_out_of_order", f"{where} comes after the conversation began; put system turns first")
        if role == "assistant":
            if not any(m["role"] == "user" for m in prefix):
                raise bad("no_user_turn", f"{where} comes before any user turn")
            if previous == "assistant":
                raise bad("roles_out_of_order", f"{where} follows another assistant turn; merge them into one")
            if current is not None:
                segments.append(Segment(current, tuple(after)))
            current, after = message, []
            open_calls = len(message.get("tool_calls") or [])
        elif role == "tool":
            if previous not in ("assistant", "tool") or open_calls == 0:
                raise bad(
                    "tool_without_call",
                    f"{where} is a tool result with no tool call before it (an assistant turn with 'tool_calls', "
                    "one result per call)",
                )
            open_calls -= 1
            after.append(message)
        else:
            if role == "user":
                open_calls = 0
            (prefix if current is None else after).append(message)
        previous = role
    if not any(m["role"] == "user" for m in prefix):
        raise bad("no_user_turn", "the conversation has no user turn")
    if current is not None:
        segments.append(Segment(current, tuple(after)))
    return TurnPlan(tuple(prefix), tuple(segments))


@dataclass(frozen=True, slots=True)
class Step:
    """What follows a generated turn: the next turn's conversation, or why the conversation ends there."""

    messages: list[Message] | None
    end: str | None = None
    detail: str = ""


def next_step(
    plan: TurnPlan,
    turn: int,
    messages: Sequence[Message],
    reply: Message,
    finish_type: str,
    *,
    on_truncated: str = "stop",
) -> Step:
    """The conversation after turn ``turn`` (1-based), generated from ``messages``, whose parsed reply is ``reply``.

    The next turn's messages are ``messages + [reply]`` and the source's messages after its assistant turn
    ``turn``, the tool results among them given the generated calls' ids (the template may print them)."""
    if finish_type == "length" and on_truncated == "stop":
        return Step(None, END_TRUNCATED, f"turn {turn} ended with finish_reason length")
    if turn >= plan.turns:
        return Step(None, END_COMPLETE)
    segment = plan.segments[turn - 1]
    calls = list(reply.get("tool_calls") or [])
    results = segment.results()
    for j, call in enumerate(calls):
        arguments = (call.get("function") or {}).get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            return Step(
                None, END_BAD_TOOL_ARGUMENTS, f"call {j} of turn {turn} has arguments that are not a JSON object"
            )
    if results and not calls:
        return Step(None, END_TOOL_CALL_MISSING, f"the source's turn {turn} called tools; the generated one did not")
    if calls and not results:
        return Step(
            None, END_TOOL_RESULTS_MISSING, f"turn {turn} called {_names(calls)}; the source has no tool results there"
        )
    if calls:
        wanted = _result_names(segment, results)
        got = [str((c.get("function") or {}).get("name")) for c in calls]
        if len(got) != len(results) or any(w is not None and w != g for w, g in zip(wanted, got, strict=False)):
            shown = ", ".join(w or "?" for w in wanted)
            return Step(
                None, END_TOOL_CALLS_DIFFER, f"turn {turn} called {_names(calls)}; the source's results answer {shown}"
            )
    spliced = [
        {**result, "tool_call_id": call.get("id")} if call.get("id") is not None else dict(result)
        for result, call in zip(results, calls, strict=False)
    ]
    rest = [dict(m) for m in segment.after[len(results) :]]
    return Step([*messages, reply, *spliced, *rest])


def first_messages(plan: TurnPlan) -> list[Message]:
    """Turn 1's conversation."""
    return [dict(m) for m in plan.prefix]


def _names(calls: Sequence[Message]) -> str:
    return ", ".join(str((c.get("function") or {}).get("name")) for c in calls) or "nothing"


def _result_names(segment: Segment, results: Sequence[Message]) -> list[str | None]:
    """The function each result answers: its ``name``, else the source call it answers (by id, else in order)."""
    source_calls = list(segment.source.get("tool_calls") or [])
    by_id = {c.get("id"): c for c in source_calls if c.get("id") is not None}
    names: list[str | None] = []
    for i, result in enumerate(results):
        if isinstance(result.get("name"), str):
            names.append(result["name"])
            continue
        call = by_id.get(result.get("tool_call_id"))
        if call is None and i < len(source_calls):
            call = source_calls[i]
        name = (call or {}).get("function", {}).get("name") if call is not None else None
        names.append(name if isinstance(name, str) else None)
    return names


def count_calls(messages: Sequence[Message]) -> int:
    """Tool calls made by the assistant turns of ``messages`` (Kimi's ids count them)."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
