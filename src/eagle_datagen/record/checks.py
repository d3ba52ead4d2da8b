"""The checks on one record: ``(prompt_ids, output_ids, finish_reason, completion_tokens)`` against a
:class:`RecordSpec` (vocabulary, stop ids, text stop strings, the model family).

:func:`check_record` is the one function the client runs on every response before it may become data
(:mod:`eagle_datagen.generate.client`) and that ``verify-shard`` runs on every stored record, so the two cannot
drift: a record verify rejects is one the client would have refused to write. Each problem is a short, stable
``kind`` and a message. Errors make the client refuse the response; warnings are written and counted.

Error kinds: ``empty_output``, ``out_of_vocab``, ``completion_tokens``, ``prompt_tail_leak``, ``stop_token``,
``length``, ``abort``, ``nan_finish``, ``finish_reason``, and the family structure (docs/verify.md):
``think_twice``, ``think_reopened``, ``think_closed_twice``, ``think_unopened``, ``think_when_off``,
``think_prompt``, ``channel_structure``. Warning kinds: ``stop_in_reasoning``, ``tool_call_ends_reasoning``.

Only C-level list operations (``min``/``max``, ``in``, ``index``, ``count``) touch the ids of a well-formed record.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle_datagen.record.family import Family, Harmony, expectation

#: Older SGLang detokenizers leaked up to this many trailing prompt ids into ``output_ids``.
PROMPT_TAIL_LEAK = 5
#: SGLang's finish when a sampled id was NaN or out of vocabulary (the id was overwritten).
NAN_FINISH = "NaN happened"

Problem = tuple[str, str]

#: Kinds the client retries (the server's fault, not the model's): an abort.
RETRYABLE_KINDS = frozenset({"abort"})


@dataclass(frozen=True)
class RecordSpec:
    """What a record is checked against. ``None`` means "not known": that part is not checked."""

    vocab_size: int | None = None
    stop_ids: frozenset[int] | None = None
    #: the plan has text stop strings (``stop``/``stop_regex``): a ``stop`` may match text
    stop_strings: bool = False
    family: Family | None = None


@dataclass
class Verdict:
    """The problems with one record: errors (it is not data) and warnings (it is, but look)."""

    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def check_record(
    spec: RecordSpec,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    finish_reason: Any,
    completion_tokens: Any,
    *,
    max_new_tokens: int | None,
    compact_output: bytes | None = None,
) -> Verdict:
    """Every per-record check; the ids are lists of ints (the caller has checked their types).

    ``compact_output``: verify-shard's speed hint, given only once it has proven on the line's bytes that both
    lists are non-negative ints (``verify._compact_int_lists``): the output ids' JSON text between the brackets,
    digits and commas only. The checks then skip the ``min()`` scans and look for early stop ids with ``memmem`` on
    that text instead of ``list.index``; the verdict is the same (a property test compares both paths)."""
    verdict = Verdict()
    if not output_ids:
        verdict.errors.append(("empty_output", "output_ids is empty"))
        return verdict
    problem = ids_problem(prompt_ids, output_ids, spec.vocab_size, non_negative=compact_output is not None)
    if problem is not None:
        verdict.errors.append(problem)
        return verdict
    for problem_or_none in (
        prompt_tail_leak_problem(prompt_ids, output_ids),
        completion_tokens_problem(output_ids, completion_tokens),
        finish_problem(
            output_ids,
            finish_reason,
            max_new_tokens=max_new_tokens,
            stop_ids=spec.stop_ids,
            stop_strings=spec.stop_strings,
            compact_output=compact_output,
        ),
    ):
        if problem_or_none is not None:
            verdict.errors.append(problem_or_none)
    if spec.family is not None and not verdict.errors and isinstance(finish_reason, dict):
        family_problems(spec.family, prompt_ids, output_ids, finish_reason, verdict)
    return verdict


def ids_problem(
    prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int | None, *, non_negative: bool = False
) -> Problem | None:
    """Every id in ``[0, vocab)`` (only ``>= 0`` when the vocabulary is not known). ``non_negative``: the caller
    has proven no id is negative (the lower bound is not scanned again)."""
    if non_negative and vocab is None:
        return None
    for name, ids in (("output_ids", output_ids), ("prompt_ids", prompt_ids)):
        if not ids:
            continue
        low, high = (0 if non_negative else min(ids)), max(ids)
        if low < 0 or (vocab is not None and high >= vocab):
            bad = low if low < 0 else high
            bound = f"the vocabulary [0, {vocab})" if vocab is not None else "[0, ...)"
            return ("out_of_vocab", f"{name}[{list(ids).index(bad)}] is {bad}, outside {bound}")
    return None


def completion_tokens_problem(output_ids: Sequence[int], completion_tokens: Any) -> Problem | None:
    """``len(output_ids)`` must equal SGLang's own ``completion_tokens`` (which counts the stop id)."""
    if completion_tokens != len(output_ids):
        return (
            "completion_tokens",
            f"len(output_ids) is {len(output_ids)} but completion_tokens is {completion_tokens}",
        )
    return None


def prompt_tail_leak_problem(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> Problem | None:
    """The output must not begin with the prompt's last ids (an SGLang detokenizer bug)."""
    n = min(PROMPT_TAIL_LEAK, len(prompt_ids))
    if n and len(output_ids) > n and output_ids[0] == prompt_ids[-n] and list(output_ids[:n]) == list(prompt_ids[-n:]):
        return ("prompt_tail_leak", f"output_ids begin with the prompt's last {n} ids")
    return None


def finish_problem(
    output_ids: Sequence[int],
    finish_reason: Any,
    *,
    max_new_tokens: int | None,
    stop_ids: Collection[int] | None = None,
    stop_strings: bool = False,
    compact_output: bytes | None = None,
) -> Problem | None:
    """The end of ``output_ids`` must agree with ``finish_reason``.

    ``stop``: ``matched`` is a stop-token id and the last id (a text match only when the plan has stop strings),
    and no stop id comes earlier. ``length``: exactly ``max_new_tokens`` ids and no stop id before the last.
    ``abort`` and SGLang's NaN finish are problems: the ids are not the model's own.
    """
    if not isinstance(finish_reason, dict) or "type" not in finish_reason:
        return ("finish_reason", f"finish_reason is {finish_reason!r}, not an object with a 'type'")
    kind = finish_reason["type"]
    if kind == "abort":
        return ("abort", f"the server aborted the request: {finish_reason.get('message')!r}")
    if kind == "stop":
        matched = finish_reason.get("matched")
        if matched == NAN_FINISH:
            return ("nan_finish", "SGLang sampled a NaN or out-of-vocabulary id and overwrote it")
        last = output_ids[-1]
        if isinstance(matched, int) and not isinstance(matched, bool):
            if last != matched:
                return ("stop_token", f"finish matched {matched} but the last output id is {last}")
            if stop_ids is not None and matched not in stop_ids:
                return ("stop_token", f"finish matched {matched}, which is not a stop id {sorted(stop_ids)}")
        elif isinstance(matched, str) and stop_strings:
            return None  # a text stop: the last token holds its end, and stop ids may come before it
        elif stop_ids is not None and last not in stop_ids:
            what = "the text " + repr(matched) if isinstance(matched, str) else repr(matched)
            return (
                "stop_token",
                f"finish 'stop' matched {what}, not a stop token, and the last output id {last} is not a stop id "
                f"{sorted(stop_ids)} (the plan has no stop strings: a server-side stop cut the output)",
            )
        return _early_stop(output_ids, stop_ids, compact_output)
    if kind == "length":
        if max_new_tokens is not None and len(output_ids) != max_new_tokens:
            return (
                "length",
                f"finish 'length' with {len(output_ids)} ids but max_new_tokens is {max_new_tokens} "
                "(the server clamped it: prompt + max_new_tokens exceeds its context)",
            )
        return _early_stop(output_ids, stop_ids, compact_output)
    return ("finish_reason", f"unknown finish type {kind!r}")


def _early_stop(
    output_ids: Sequence[int], stop_ids: Collection[int] | None, compact_output: bytes | None = None
) -> Problem | None:
    """A stop id before the last position means generation went past it (ignore_eos or min_new_tokens)."""
    if not stop_ids:
        return None
    end = len(output_ids) - 1
    if compact_output is not None:  # "a,b,...,z": a stop id among all but the last starts it or is ",s," before z
        text = compact_output
        last_comma = text.rfind(b",")
        stop_ids = [
            s for s in stop_ids
            if last_comma >= 0 and (text.startswith(b"%d," % s) or text.find(b",%d," % s, 0, last_comma + 1) >= 0)
        ]  # fmt: skip
    for stop in stop_ids:
        try:
            at = output_ids.index(stop, 0, end)
        except ValueError:
            continue
        return (
            "stop_token",
            f"output_ids[{at}] is the stop id {stop} but generation went on (ignore_eos or min_new_tokens "
            "reached the server)",
        )
    return None


# --- the family structure ----------------------------------------------------------------------------------------


def family_problems(
    family: Family,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    finish: dict[str, Any],
    verdict: Verdict,
) -> None:
    """The output's reasoning (or harmony) structure, as this record's prompt asks for it."""
    expect = expectation(family, prompt_ids)
    if expect == "free":
        return
    stopped = finish.get("type") == "stop"
    if expect == "harmony":
        assert family.harmony is not None
        harmony_problems(family.harmony, output_ids, stopped, verdict)
        return
    think_open, think_close = family.think_open, family.think_close
    assert think_open is not None and think_close is not None
    if expect == "bad_prompt":
        verdict.errors.append(("think_prompt", _bad_prompt_message(family, prompt_ids)))
        return
    if expect == "off":
        if think_open in output_ids or think_close in output_ids:
            token = think_open if think_open in output_ids else think_close
            at = list(output_ids).index(token)
            verdict.errors.append(
                ("think_when_off", f"the prompt turned thinking off, yet output_ids[{at}] is think token {token}")
            )
        return
    start = 0
    if expect == "must_open":
        prefix = next(
            (
                p
                for p in family.output_prefixes
                if len(output_ids) > len(p)
                and output_ids[len(p)] == think_open
                and list(output_ids[: len(p)]) == list(p)
            ),
            None,
        )
        if prefix is None:
            if not stopped and len(output_ids) <= max(len(p) for p in family.output_prefixes):
                return  # cut before it could open
            allowed = " or ".join(str(list(p)) if p else "nothing" for p in family.output_prefixes)
            verdict.errors.append(
                (
                    "think_unopened",
                    f"the template leaves reasoning to the model, but the output does not start with think-open "
                    f"{think_open} (after {allowed}); it starts {list(output_ids[:6])}",
                )
            )
            return
        start = len(prefix) + 1
    try:
        close = output_ids.index(think_close, start)
    except ValueError:
        close = -1
    if think_open in output_ids[start : close if close >= 0 else len(output_ids)]:
        at = list(output_ids).index(think_open, start)
        opened = "the prompt" if expect == "inside" else f"output_ids[{start - 1}]"
        verdict.errors.append(
            ("think_twice", f"{opened} already opened reasoning, yet output_ids[{at}] opens it again")
        )
        return
    if close >= 0:
        rest = output_ids[close + 1 :]
        if think_open in rest:
            at = close + 1 + list(rest).index(think_open)
            verdict.errors.append(
                ("think_reopened", f"reasoning closed at output_ids[{close}] and reopens at output_ids[{at}]")
            )
        elif think_close in rest:
            at = close + 1 + list(rest).index(think_close)
            verdict.errors.append(
                ("think_closed_twice", f"reasoning closed at output_ids[{close}] and again at output_ids[{at}]")
            )
        return
    if stopped:
        tool = next((t for t in family.tool_call_ids if t in output_ids), None)
        if tool is not None:
            verdict.warnings.append(
                (
                    "tool_call_ends_reasoning",
                    f"a tool call (id {tool} at output_ids[{list(output_ids).index(tool)}]) ends reasoning without "
                    "think-close",
                )
            )
        else:
            verdict.warnings.append(
                ("stop_in_reasoning", f"finished with 'stop' inside reasoning (no think-close {think_close})")
            )


def _bad_prompt_message(family: Family, prompt_ids: Sequence[int]) -> str:
    return (
        f"the prompt ends with the generation prompt's head but not its think-open {family.think_open} "
        f"(it ends {list(prompt_ids[-4:])})"
    )


def harmony_problems(harmony: Harmony, output_ids: Sequence[int], stopped: bool, verdict: Verdict) -> None:
    """gpt-oss: ``<|channel|>NAME…<|message|>…`` messages; ``analysis`` and ``commentary`` end ``<|end|>`` and are
    followed by ``<|start|>assistant``; a tool call ends ``<|call|>``, the ``final`` answer ``<|return|>``."""
    ids = output_ids
    positions = sorted(i for m in harmony.markers for i in _positions(ids, m))
    state = "channel"  # what the next marker must be: channel, message (constrain may come first), end, start
    channel_at = -1
    name = ""
    for at in positions:
        token = ids[at]
        if state == "start":
            if at != channel_at or token != harmony.start:
                verdict.errors.append(
                    ("channel_structure", f"output_ids[{channel_at}] should be <|start|> {harmony.start} after <|end|>")
                )
                return
            role = list(ids[at + 1 : at + 1 + len(harmony.role)])
            if role and role != list(harmony.role)[: len(role)]:
                verdict.errors.append(("channel_structure", f"the message at output_ids[{at}] is not the assistant's"))
                return
            state = "channel"
        elif state == "channel":
            if token != harmony.channel:
                verdict.errors.append(
                    ("channel_structure", f"output_ids[{at}] is marker {token} where <|channel|> belongs")
                )
                return
            channel_at, state = at, "message"
        elif state == "message":
            if token == harmony.constrain:
                continue
            if token != harmony.message:
                verdict.errors.append(
                    ("channel_structure", f"output_ids[{at}] is marker {token} where <|message|> belongs")
                )
                return
            header = list(ids[channel_at + 1 : at])
            found = next((n for n, t in harmony.channels.items() if t and header[: len(t)] == list(t)), None)
            if found is None:
                verdict.errors.append(
                    (
                        "channel_structure",
                        f"the channel at output_ids[{channel_at}] is none of {', '.join(harmony.channels)}",
                    )
                )
                return
            name, state = found, "end"
        else:  # state == "end": the message's terminator
            problem = _harmony_end(harmony, name, token, at, len(ids))
            if problem is not None:
                verdict.errors.append(("channel_structure", problem))
                return
            if token in (harmony.return_, harmony.call):
                return
            channel_at, state = at + 1, "start"  # channel_at: where <|start|> must stand
    if not stopped:
        return  # cut by the length limit: what there is was well formed
    if state == "end" and name == "analysis":
        verdict.warnings.append(("stop_in_reasoning", f"stopped by {ids[-1]} inside the analysis message"))
        return
    where = {"channel": "before a <|channel|>", "message": "inside a message header", "start": "after <|end|>"}
    verdict.errors.append(
        (
            "channel_structure",
            f"stopped by {ids[-1]} {where.get(state, f'inside the {name} message')}, not with <|return|> "
            f"{harmony.return_} after final or <|call|> {harmony.call} after a tool call",
        )
    )


def _harmony_end(harmony: Harmony, name: str, token: int, at: int, n: int) -> str | None:
    if token == harmony.end:
        if name == "final":
            return f"the final message ends with <|end|> at output_ids[{at}], not <|return|> {harmony.return_}"
        return None
    if token == harmony.return_:
        if name != "final":
            return f"the {name} message ends with <|return|> at output_ids[{at}]; only final may"
    elif token == harmony.call:
        if name == "final":
            return f"the final message ends with <|call|> at output_ids[{at}]; only a tool call may"
    else:
        return f"output_ids[{at}] is marker {token} inside the {name} message's text"
    if at != n - 1:
        return f"output_ids go on after the {name} message ended at output_ids[{at}]"
    return None


def _positions(ids: Sequence[int], token: int) -> list[int]:
    found: list[int] = []
    at = -1
    while True:
        try:
            at = ids.index(token, at + 1)
        except ValueError:
            return found
        found.append(at)
