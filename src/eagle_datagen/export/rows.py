"""Records → training rows: ``input_ids = prompt_ids + output_ids``, ``loss_mask`` 0 over the prompt and 1
over the output (stop token included), turn merging and the length limit.

A row is a list of segments ``(ids as JSON text, count, mask value)``, so the JSONL formats write the ids as
the bytes they were stored as and the mask as repeated ``0,``/``1,``; nothing decodes the ids unless a row
is merged or cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import orjson

from eagle_datagen.export.source import Buffer, Record

OverLength = Literal["cut", "drop"]
FINISH_KINDS = ("stop", "length")

Segment = tuple[Buffer, int, int]
#: masks up to this many ids are views into one prebuilt ``0,0,...`` / ``1,1,...`` text
MASK_CACHE = 1 << 17
_MASKS = {0: b"0," * MASK_CACHE, 1: b"1," * MASK_CACHE}


def mask_text(n: int, value: int) -> Buffer:
    """``0,0,0`` (``n`` values) without a trailing comma."""
    if n <= MASK_CACHE:
        return memoryview(_MASKS[value])[: 2 * n - 1]
    return _MASKS[value][:2] * (n - 1) + _MASKS[value][:1]


@dataclass(slots=True)
class TrainRow:
    """One training row (a record, or a merged conversation)."""

    id: str
    key: str
    sample: int
    segments: list[Segment]
    finish: str
    conversation: str | None
    turn: int | None
    turns: int = 1

    @property
    def length(self) -> int:
        return sum(n for _, n, _ in self.segments)

    @property
    def prompt_len(self) -> int:
        """Ids before the first trained one (the first turn's prompt)."""
        first = next((i for i, (_, _, m) in enumerate(self.segments) if m), len(self.segments))
        return sum(n for _, n, _ in self.segments[:first])

    @property
    def loss_tokens(self) -> int:
        return sum(n for _, n, m in self.segments if m)

    def ids_parts(self) -> list[Buffer]:
        """The ids' JSON text (without brackets) as pieces to join: no copy of the ids."""
        parts: list[Buffer] = []
        for text, _, _ in self.segments:
            if parts:
                parts.append(b",")
            parts.append(text)
        return parts

    def mask_parts(self) -> list[Buffer]:
        parts: list[Buffer] = []
        for _, n, m in self.segments:
            if parts:
                parts.append(b",")
            parts.append(mask_text(n, m))
        return parts

    def ids_json(self) -> bytes:
        return b"".join([b"[", *self.ids_parts(), b"]"])

    def mask_json(self) -> bytes:
        return b"".join([b"[", *self.mask_parts(), b"]"])

    def ids(self) -> list[int]:
        ids: list[int] = orjson.loads(self.ids_json())
        return ids

    def mask(self) -> list[int]:
        out: list[int] = []
        for _, n, m in self.segments:
            out += [m] * n
        return out

    def trained_ids(self) -> list[int]:
        """The ids under mask 1 (what ``vocab-map`` counts)."""
        out: list[int] = []
        for text, _, m in self.segments:
            if m:
                out += orjson.loads(b"".join([b"[", text, b"]"]))
        return out


def segments_from(ids: Sequence[int], mask: Sequence[int]) -> list[Segment]:
    """Segments of runs of equal mask values."""
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            segments.append((orjson.dumps(list(ids[start:i]))[1:-1], i - start, mask[start]))
            start = i
    return segments


def single_row(record: Record) -> TrainRow:
    return TrainRow(
        id=record.id,
        key=record.key,
        sample=record.sample,
        segments=[(record.prompt_text, record.prompt_len, 0), (record.output_text, record.output_len, 1)],
        finish=record.finish,
        conversation=record.conversation,
        turn=record.turn,
    )


def merge_turns(records: list[Record]) -> tuple[TrainRow | None, str | None]:
    """One row for a conversation's turns when every turn's prompt extends the previous row exactly.

    Returns ``(row, None)``, or ``(None, reason)`` when the conversation must stay one row per turn:
    ``missing_turn`` (turns are not exactly 1..K), ``duplicate_turn``, or ``history_changed`` (a turn's
    prompt does not start with the previous prompt + output: the template rewrote history, e.g. dropped
    the reasoning)."""
    records = sorted(records, key=lambda r: r.turn or 0)
    turns = [r.turn for r in records]
    if len(set(turns)) != len(turns):
        return None, "duplicate_turn"
    if turns != list(range(1, len(records) + 1)):
        return None, "missing_turn"
    first = records[0]
    ids = first.prompt_ids() + first.output_ids()
    segments: list[Segment] = [(first.prompt_text, first.prompt_len, 0), (first.output_text, first.output_len, 1)]
    for record in records[1:]:
        prompt = record.prompt_ids()
        if len(prompt) < len(ids) or prompt[: len(ids)] != ids:
            return None, "history_changed"
        new = prompt[len(ids) :]
        if new:
            segments.append((orjson.dumps(new)[1:-1], len(new), 0))
        segments.append((record.output_text, record.output_len, 1))
        ids = prompt + record.output_ids()
    last = records[-1]
    suffix = f"@t{last.turn}"
    rid = last.id[: -len(suffix)] if last.id.endswith(suffix) else last.conversation or last.key
    return (
        TrainRow(
            id=rid,
            key=last.key,
            sample=last.sample,
            segments=segments,
            finish=last.finish,
            conversation=last.conversation,
            turn=last.turn,
            turns=len(records),
        ),
        None,
    )


@dataclass(frozen=True)
class RowOptions:
    """What a row must satisfy to be written."""

    include_finish: frozenset[str] = frozenset(FINISH_KINDS)
    max_length: int | None = None
    over_length: OverLength = "cut"
    merge_turns: bool = False


@dataclass
class RowCounts:
    """Rows written and left out, by reason."""

    records: int = 0
    rows: int = 0
    left_out: Counter[str] = field(default_factory=Counter)
    cut_rows: int = 0
    cut_tokens: int = 0
    merged_conversations: int = 0
    merged_records: int = 0
    merge_fallback: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    loss_tokens: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "records_read": self.records,
            "rows_written": self.rows,
            "left_out": dict(sorted(self.left_out.items())),
            "cut_rows": self.cut_rows,
            "cut_tokens": self.cut_tokens,
            "merged_conversations": self.merged_conversations,
            "merged_records": self.merged_records,
            "merge_fallback_conversations": dict(sorted(self.merge_fallback.items())),
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
        }


def limit_length(row: TrainRow, options: RowOptions, counts: RowCounts) -> TrainRow | None:
    """Applies ``--max-length``: the row as is, cut to the limit, or ``None`` (dropped, counted)."""
    limit = options.max_length
    if limit is None or row.length <= limit:
        return row
    if options.over_length == "drop":
        counts.left_out["max_length"] += 1
        return None
    ids, mask = row.ids()[:limit], row.mask()[:limit]
    if not any(mask):
        counts.left_out["max_length_no_output"] += 1
        return None
    counts.cut_rows += 1
    counts.cut_tokens += row.length - limit
    row.segments = segments_from(ids, mask)
    return row


def finish_allowed(record: Record, options: RowOptions, counts: RowCounts) -> bool:
    if record.finish in options.include_finish:
        return True
    counts.left_out[f"finish_{record.finish}"] += 1
    return False
