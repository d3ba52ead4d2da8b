"""Read a finished run directory record by record, each one through verify's own per-record checks.

:func:`scan` streams the finalized shards once. Every line goes through :class:`verify.Checker` (the very
checks ``verify-shard`` runs, the re-render excepted), so a record that ``verify-shard`` would report is
never handed on as training data: the callback gets each record with the first problem verify found in it
(or ``None``). What only the whole directory shows (a shard's sha256 or count against the manifest, a missing
shard, records whose prompt shape differs from the run's) lands in the returned :class:`verify.Report`.

A directory is read only when no writer holds it (``DIR/.lock``) and only its finalized shards are read: a
``.partial`` shard belongs to a run that has not finished; its records are counted, not exported.

Records are parsed without decoding their two id lists where the writer's compact layout allows it: the
ids stay the bytes they were written as (``prompt_text`` / ``output_text``, without brackets), which is
what the JSONL formats copy, and only the small rest of the line is parsed.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.errors import UsageError
from eagle_datagen.store.lock import is_locked
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.verify.verify import Checker, Options, Report, Setup, ShardTarget

READ_BUFFER = 1 << 20
PROGRESS_STEP = 1 << 22
_PROMPT_KEY = b'"prompt_ids":['
_OUTPUT_KEY = b'],"output_ids":['
#: ids as JSON text: a view into the record line on the fast path (no copy), else bytes
Buffer = bytes | memoryview


@dataclass(slots=True)
class Record:
    """One checked record; the id lists are kept as their JSON text (``1,2,3``) and counts."""

    id: str
    key: str
    sample: int
    prompt_text: Buffer
    output_text: Buffer
    prompt_len: int
    output_len: int
    finish: str
    conversation: str | None
    turn: int | None

    def prompt_ids(self) -> list[int]:
        return _ids(self.prompt_text)

    def output_ids(self) -> list[int]:
        return _ids(self.output_text)


def _ids(text: Buffer) -> list[int]:
    ids: list[int] = orjson.loads(b"[" + text + b"]")
    return ids


def parse_record(raw: bytes) -> Record:
    """A :class:`Record` from one line that passed verify's checks (so both id lists are non-empty ints, and
    ``completion_tokens`` is the output's length)."""
    fields: dict[str, Any] | None = None
    start = raw.find(_PROMPT_KEY)
    if start > 0:
        p0 = start + len(_PROMPT_KEY)
        p1 = raw.find(b"]", p0)
        if p1 > 0 and raw.startswith(_OUTPUT_KEY, p1):
            o0 = p1 + len(_OUTPUT_KEY)
            o1 = raw.find(b"]", o0)
            head = raw[:start].rstrip()
            tail = raw[o1 + 1 :].strip()
            try:
                first = orjson.loads(head[:-1] + b"}" if head.endswith(b",") else head + b"}")
                rest = orjson.loads(b"{" + tail[1:] if tail.startswith(b",") else b"{" + tail)
            except orjson.JSONDecodeError:
                first = rest = None
            if type(first) is dict and type(rest) is dict:
                fields = first | rest
                view = memoryview(raw)
                prompt_text: Buffer = view[p0:p1]
                output_text: Buffer = view[o0:o1]
                prompt_len = raw.count(b",", p0, p1) + 1
                # verify proved completion_tokens == len(output_ids): no need to count the longer list
                done = fields.get("completion_tokens")
                output_len = done if type(done) is int else raw.count(b",", o0, o1) + 1
    if fields is None:  # another layout (hand-written, spaces): parse it all, write the ids compactly
        fields = orjson.loads(raw)
        prompt_text = orjson.dumps(fields["prompt_ids"])[1:-1]
        output_text = orjson.dumps(fields["output_ids"])[1:-1]
        prompt_len, output_len = len(fields["prompt_ids"]), len(fields["output_ids"])
    conversation = fields.get("conversation")
    turn = fields.get("turn")
    finish = fields.get("finish_reason")
    return Record(
        id=fields["id"],
        key=fields["key"],
        sample=fields["sample"],
        prompt_text=prompt_text,
        output_text=output_text,
        prompt_len=prompt_len,
        output_len=output_len,
        finish=str(finish.get("type")) if isinstance(finish, dict) else str(finish),
        conversation=conversation if isinstance(conversation, str) else None,
        turn=turn if type(turn) is int else None,
    )


@dataclass(frozen=True, slots=True)
class Location:
    """Where a record line lies: the shard's index in :attr:`Source.files`, the byte offset and length."""

    file: int
    offset: int
    length: int


#: ``(raw line, where it lies, the first problem verify found in it or None)``
RecordSink = Callable[[bytes, Location, "str | None"], None]


@dataclass
class Source:
    """A finished run directory opened for reading."""

    directory: Path
    manifest: Manifest
    targets: list[ShardTarget]
    files: list[Path]
    report: Report
    setup: Setup
    partial_records: int = 0
    partial_files: list[str] = field(default_factory=list)

    @property
    def plan_sha256(self) -> str:
        return plan_sha256(self.manifest.plan)

    @property
    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def read(self, where: Location) -> bytes:
        """One record line again (for the second pass of ``--shuffle-seed`` / ``--merge-turns``)."""
        with self.files[where.file].open("rb") as handle:
            handle.seek(where.offset)
            return handle.read(where.length)


def plan_sha256(plan: dict[str, Any]) -> str:
    """The sha256 of the plan's canonical JSON (sorted keys): what export.json ties an export to."""
    return hashlib.sha256(orjson.dumps(plan, option=orjson.OPT_SORT_KEYS)).hexdigest()


def open_source(directory: Path, *, max_examples: int = 20) -> Source:
    """Opens ``directory`` for reading: refuses a live writer and anything that is not a run directory."""
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory; give the run's output directory (the --out of `run`)")
    if not (directory / MANIFEST_NAME).is_file():
        raise UsageError(
            f"{directory} has no {MANIFEST_NAME}: it is not an eagle-datagen output directory "
            "(give the directory that `eagle-datagen run --out` wrote, not its shards/ folder)"
        )
    check_no_writer(directory)
    manifest = Manifest.load(directory)
    report = Report(max_examples=max_examples)
    setup = Setup(Options(None, None, False, rerender=False), report)
    targets: list[ShardTarget] = []
    partials: list[ShardTarget] = []
    for target in setup.targets([directory]):
        (partials if target.partial else targets).append(target)
    source = Source(directory, manifest, targets, [t.path for t in targets], report, setup)
    for target in partials:
        source.partial_files.append(target.path.name)
        source.partial_records += _count_lines(target.path)
    return source


def check_no_writer(directory: Path) -> None:
    """Refuses a directory whose ``.lock`` a live ``run``/``resume`` holds (:func:`store.lock.is_locked`).

    Finalized shards never change afterwards, so checking once at the start is enough; a run started later
    only adds shards, which this read does not see."""
    holder = is_locked(directory)
    if holder is not None:
        raise UsageError(
            f"{holder.describe(directory)}: a run is still writing there. Export reads finished shards only: "
            f"wait for the run to end (or stop it{holder.stop_hint()}, then `eagle-datagen resume --out "
            f"{directory}` to finish it) and export again"
        )


def _count_lines(path: Path) -> int:
    count = 0
    with path.open("rb") as handle:
        while chunk := handle.read(READ_BUFFER):
            count += chunk.count(b"\n")
    return count


class _RowChecker(Checker):
    """verify's :class:`Checker`, telling the caller about each record and the first problem found in it."""

    def __init__(self, report: Report, sink: RecordSink, on_bytes: Callable[[int], None] | None) -> None:
        super().__init__(report)
        self.sink = sink
        self.on_bytes = on_bytes
        self.file = -1
        self.offset = 0
        self.problem: str | None = None
        self.inside = False
        self.record_errors = 0

    def check(self, target: ShardTarget) -> None:
        self.file += 1
        self.offset = 0
        super().check(target)

    def error(self, kind: str, line: int | None, rid: str | None, message: str) -> None:
        super().error(kind, line, rid, message)
        if self.inside:
            self.record_errors += 1
            if self.problem is None:
                self.problem = kind

    def record(self, raw: bytes, line: int) -> None:
        self.problem = None
        self.inside = True
        try:
            super().record(raw, line)
        finally:
            self.inside = False
        self.sink(raw, Location(self.file, self.offset, len(raw)), self.problem)
        self.offset += len(raw)
        if self.on_bytes is not None:
            self.on_bytes(len(raw))


@dataclass
class ScanResult:
    """What the scan found beyond the records it handed on."""

    report: Report
    #: errors verify reported outside any one record (shard sha256/count, missing shards, run-wide shape)
    directory_errors: int


def scan(source: Source, sink: RecordSink, *, on_bytes: Callable[[int], None] | None = None) -> ScanResult:
    """Streams every finalized shard through verify's checks, calling ``sink`` for each record line."""
    started = time.perf_counter()
    checker = _RowChecker(source.report, sink, on_bytes)
    for target in source.targets:
        try:
            checker.check(target)
        except OSError as exc:
            raise UsageError(f"cannot read {target.path}: {exc.strerror or exc}") from exc
    checker.settle(list(source.setup.contexts.values()))
    source.report.elapsed_s = time.perf_counter() - started
    total = sum(source.report.errors.values())
    return ScanResult(source.report, total - checker.record_errors)


class Progress:
    """A tqdm bar fed in steps (``PROGRESS_STEP`` bytes, or 1,000 of any other unit); silent when disabled."""

    def __init__(self, total: int, enabled: bool, desc: str, unit: str = "B") -> None:
        self.bar: Any = None
        self.pending = 0
        self.step = PROGRESS_STEP if unit == "B" else 1000
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit=unit, unit_scale=True, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False
            )

    def update(self, n: int) -> None:
        if self.bar is None:
            return
        self.pending += n
        if self.pending >= self.step:
            self.bar.update(self.pending)
            self.pending = 0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.pending)
            self.bar.close()
