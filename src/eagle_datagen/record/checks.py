"""Checks on one (prompt_ids, output_ids, finish_reason) triple.

Shared by the client (a response failing a check is never written as data) and by
``verify-shard`` (which re-proves the same facts over finished shards). Each check returns
``None`` or a ``(kind, message)`` problem.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

#: Older SGLang detokenizers leaked up to this many trailing prompt ids into ``output_ids``.
PROMPT_TAIL_LEAK = 5
#: SGLang's finish when a sampled id was NaN or out of vocabulary (the id was overwritten).
NAN_FINISH = "NaN happened"

Problem = tuple[str, str]


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
    if n and len(output_ids) > n and list(output_ids[:n]) == list(prompt_ids[-n:]):
        return ("prompt_tail_leak", f"output_ids begin with the prompt's last {n} ids")
    return None


def finish_problem(
    output_ids: Sequence[int],
    finish_reason: Any,
    *,
    max_new_tokens: int | None,
    stop_ids: Collection[int] | None = None,
) -> Problem | None:
    """The end of ``output_ids`` must agree with ``finish_reason``.

    ``stop`` on a token: the last id is the matched one (and a known stop id when ``stop_ids`` is
    given). ``length``: exactly ``max_new_tokens`` ids. ``abort`` and SGLang's NaN finish are
    problems: the ids are not the model's own.
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
        if isinstance(matched, int) and not isinstance(matched, bool):
            if not output_ids or output_ids[-1] != matched:
                last = output_ids[-1] if output_ids else None
                return ("stop_token", f"finish matched {matched} but the last output id is {last}")
            if stop_ids is not None and matched not in stop_ids:
                return ("stop_token", f"finish matched {matched}, which is not a stop id {sorted(stop_ids)}")
        return None
    if kind == "length":
        if max_new_tokens is not None and len(output_ids) != max_new_tokens:
            return (
                "length",
                f"finish 'length' with {len(output_ids)} ids but max_new_tokens is {max_new_tokens} "
                "(the server clamped it: prompt + max_new_tokens exceeds its context)",
            )
        return None
    return ("finish_reason", f"unknown finish type {kind!r}")


def response_problem(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    finish_reason: Any,
    completion_tokens: Any,
    *,
    max_new_tokens: int | None,
    stop_ids: Collection[int] | None = None,
) -> Problem | None:
    """The first problem with one response, or ``None`` when it may be written as data."""
    if not output_ids:
        return ("empty_output", "output_ids is empty")
    return (
        prompt_tail_leak_problem(prompt_ids, output_ids)
        or completion_tokens_problem(output_ids, completion_tokens)
        or finish_problem(output_ids, finish_reason, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    )
