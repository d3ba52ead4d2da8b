"""``eagle-datagen export``: a finished run directory → one trainer's data, checked row by row.

One streaming pass reads every finalized shard through verify's per-record checks and writes each good
record's row at once. ``--shuffle-seed`` and ``--merge-turns`` need the rows in another order: the first
pass then keeps only where each record lies (a few dozen bytes per record) and a second pass reads them back
in the new order. Everything is written to a staging directory beside ``--out`` and renamed into place
only when the export is complete and accepted, so ``--out`` never holds half an export.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen import __version__
from eagle_datagen.errors import DatagenError, UsageError
from eagle_datagen.export.formats import Format, Writer, check_dependencies, open_writer
from eagle_datagen.export.rows import (
    RowCounts,
    RowOptions,
    TrainRow,
    finish_allowed,
    limit_length,
    merge_turns,
    single_row,
)
from eagle_datagen.export.source import Location, Progress, Record, ScanResult, Source, open_source, parse_record, scan
from eagle_datagen.store.durable import write_atomic
from eagle_datagen.verify.verify import Report, format_report

EXPORT_JSON = "export.json"
EXPORT_FORMAT = 1


class ExportRefused(DatagenError):
    """The directory has errors ``verify-shard`` reports (and ``--skip-invalid`` was not given)."""


@dataclass(frozen=True)
class ExportOptions:
    directory: Path
    fmt: Format
    out: Path
    rows: RowOptions
    shuffle_seed: int | None = None
    skip_invalid: bool = False
    progress: bool = True


@dataclass
class ExportResult:
    out: Path
    counts: RowCounts
    summary: str
    manifest: dict[str, Any]


# --- staging ----------------------------------------------------------------------------------------


def prepare_out(out: Path) -> Path:
    """Refuses an ``--out`` that holds anything; returns the staging directory beside it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} already exists and is not an empty directory; remove it or choose another")
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _sweep_stale(out: Path) -> None:
    """Removes the staging directories an export killed before its cleanup left beside ``out``."""
    for path in out.parent.glob(f".{out.name}.partial-*"):
        match = re.search(r"\.partial-(\d+)(\.arrow-tmp)?$", path.name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def publish(staging: Path, out: Path) -> None:
    if out.is_dir():
        out.rmdir()  # empty (checked at the start)
    os.replace(staging, out)


# --- the passes --------------------------------------------------------------------------------------


class _Index:
    """Where the accepted records lie (for the second pass): three packed arrays, not objects."""

    def __init__(self) -> None:
        self.files = array("H")
        self.offsets = array("q")
        self.lengths = array("i")

    def add(self, where: Location) -> int:
        self.files.append(where.file)
        self.offsets.append(where.offset)
        self.lengths.append(where.length)
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return len(self.offsets)


class _Reader:
    """Reads record lines back by position with ``os.pread`` on descriptors kept open."""

    def __init__(self, source: Source, index: _Index) -> None:
        self.index = index
        self.fds = [os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in source.files]

    def record(self, i: int) -> Record:
        index = self.index
        return parse_record(os.pread(self.fds[index.files[i]], index.lengths[i], index.offsets[i]))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


class Exporter:
    """Turns checked records into rows and hands them to a writer, counting what it leaves out."""

    def __init__(self, options: ExportOptions, writer: Writer) -> None:
        self.options = options
        self.writer = writer
        self.counts = RowCounts()
        self.index = _Index() if options.shuffle_seed is not None or options.rows.merge_turns else None
        #: (conversation, sample) → record indices, in first-seen order (--merge-turns)
        self.groups: dict[tuple[str, int], list[int]] = {}
        self.singles = array("q")

    def take(self, raw: bytes, where: Location, problem: str | None) -> None:
        """The scan's callback: one record line and verify's verdict on it."""
        counts = self.counts
        counts.records += 1
        if problem is not None:
            counts.left_out[f"invalid_{problem}"] += 1
            return
        record = parse_record(raw)
        if not finish_allowed(record, self.options.rows, counts):
            return
        if self.index is None:
            self.emit(single_row(record))
            return
        i = self.index.add(where)
        if self.options.rows.merge_turns and record.conversation is not None and record.turn is not None:
            self.groups.setdefault((record.conversation, record.sample), []).append(i)
        else:
            self.singles.append(i)

    def emit(self, row: TrainRow) -> None:
        limited = limit_length(row, self.options.rows, self.counts)
        if limited is None:
            return
        self.writer.write(limited)
        self.counts.rows += 1
        self.counts.tokens += limited.length
        self.counts.loss_tokens += limited.loss_tokens

    def second_pass(self, source: Source, on_row: Callable[[int], None]) -> None:
        """Reads the kept records back (shuffled, grouped by conversation) and writes their rows."""
        if self.index is None:
            return
        reader = _Reader(source, self.index)
        try:
            for unit in self._units():
                records = [reader.record(i) for i in unit]
                self._emit_unit(records)
                on_row(len(records))
        finally:
            reader.close()

    def _units(self) -> Iterator[list[int]]:
        seed = self.options.shuffle_seed
        if not self.groups:  # one record per unit: shuffle the packed index itself
            order = self.singles
            if seed is not None:
                random.Random(seed).shuffle(order)
            for i in order:
                yield [i]
            return
        units: list[list[int]] = [*self.groups.values(), *([i] for i in self.singles)]
        self.groups = {}
        if seed is not None:
            random.Random(seed).shuffle(units)
        yield from units

    def _emit_unit(self, records: list[Record]) -> None:
        first = records[0]
        if not self.options.rows.merge_turns or first.conversation is None or first.turn is None:
            for record in records:
                self.emit(single_row(record))
            return
        row, reason = merge_turns(records)
        if row is None:
            self.counts.merge_fallback[reason or "unknown"] += 1
            for record in sorted(records, key=lambda r: r.turn or 0):
                self.emit(single_row(record))
            return
        self.counts.merged_conversations += 1
        self.counts.merged_records += len(records)
        self.emit(row)


def export(options: ExportOptions) -> ExportResult:
    """Runs one export; raises :class:`ExportRefused` (nothing written) when the directory fails verify."""
    started = time.perf_counter()
    check_dependencies(options.fmt)
    source = open_source(options.directory)
    staging = prepare_out(options.out)
    try:
        writer = open_writer(options.fmt, staging, plan=source.manifest.plan, plan_sha256=source.plan_sha256)
        exporter = Exporter(options, writer)
        try:
            bar = Progress(source.total_bytes, options.progress, "export: checking shards")
            try:
                result = scan(source, exporter.take, on_bytes=bar.update)
            finally:
                bar.close()
            _refuse_invalid(source, result, options)
            if exporter.index is not None:
                rows_bar = Progress(len(exporter.index), options.progress, "export: writing rows", unit="rec")
                try:
                    exporter.second_pass(source, rows_bar.update)
                finally:
                    rows_bar.close()
            if exporter.counts.rows == 0:
                left = ", ".join(f"{k} {n:,}" for k, n in sorted(exporter.counts.left_out.items())) or "no records"
                raise ExportRefused(
                    f"no row is left to export from {exporter.counts.records:,} records ({left}); nothing was "
                    "written. Loosen --include-finish / --max-length, or check the run"
                )
        except BaseException:
            writer.abort()
            raise
        files = writer.close()
        manifest = _export_json(source, options, exporter.counts, result, files, time.perf_counter() - started)
        write_atomic(staging / EXPORT_JSON, orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")
        publish(staging, options.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    summary = format_summary(source, options, exporter.counts, result, files)
    return ExportResult(options.out, exporter.counts, summary, manifest)


def _refuse_invalid(source: Source, result: ScanResult, options: ExportOptions) -> None:
    report = result.report
    if report.ok or options.skip_invalid:
        return
    raise ExportRefused(
        f"{source.directory} has records or shards that verify-shard rejects; nothing was exported.\n"
        + format_report(report)
        + "\nFix the directory (see `eagle-datagen verify-shard "
        + f"{source.directory}`), or export again with --skip-invalid to leave the failing records out (counted)."
    )


def _export_json(
    source: Source, options: ExportOptions, counts: RowCounts, result: ScanResult, files: list[str], wall_s: float
) -> dict[str, Any]:
    recorded = source.manifest.shard_map()
    report: Report = result.report
    return {
        "format": EXPORT_FORMAT,
        "tool_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "export_format": options.fmt,
        "files": files,
        "source": {
            "directory": str(source.directory.resolve()),
            "plan_sha256": source.plan_sha256,
            "manifest_created": source.manifest.created,
            "shards": [
                {
                    "name": path.name,
                    "records": info.records if (info := recorded.get(path.name)) else None,
                    "sha256": info.sha256 if info else None,
                }
                for path in source.files
            ],
            "partial_shards_not_read": source.partial_files,
            "partial_records_not_read": source.partial_records,
        },
        "options": {
            "include_finish": sorted(options.rows.include_finish),
            "max_length": options.rows.max_length,
            "over_length": options.rows.over_length,
            "merge_turns": options.rows.merge_turns,
            "shuffle_seed": options.shuffle_seed,
            "skip_invalid": options.skip_invalid,
        },
        "counts": counts.to_json(),
        "verify": {
            "errors": dict(sorted(report.errors.items())),
            "warnings": dict(sorted(report.warnings.items())),
            "directory_errors": result.directory_errors,
            "not_checked": list(report.not_checked),
        },
        "wall_s": round(wall_s, 3),
    }


def format_summary(
    source: Source, options: ExportOptions, counts: RowCounts, result: ScanResult, files: list[str]
) -> str:
    """The lines printed at the end: what was written, what was left out and why."""
    lines = [
        f"exported {counts.rows:,} rows ({counts.tokens:,} tokens, {counts.loss_tokens:,} trained) from "
        f"{counts.records:,} records in {len(source.files)} shard(s) → {options.out} ({options.fmt}: "
        f"{', '.join(files[:3])}{', ...' if len(files) > 3 else ''} + {EXPORT_JSON})"
    ]
    if counts.left_out:
        parts = ", ".join(f"{kind} {n:,}" for kind, n in sorted(counts.left_out.items()))
        lines.append(f"left out: {sum(counts.left_out.values()):,} ({parts})")
    else:
        lines.append("left out: none")
    if options.rows.max_length is not None:
        limit = f"--max-length {options.rows.max_length}"
        if options.rows.over_length == "drop":
            lines.append(f"{limit} (drop): {counts.left_out['max_length']:,} longer rows dropped")
        else:
            lines.append(
                f"{limit} (cut): {counts.cut_rows:,} rows cut ({counts.cut_tokens:,} tokens removed), "
                f"{counts.left_out['max_length_no_output']:,} dropped with no output within the limit"
            )
    if options.rows.merge_turns:
        fallback = ", ".join(f"{k} {n:,}" for k, n in sorted(counts.merge_fallback.items())) or "none"
        lines.append(
            f"--merge-turns: {counts.merged_conversations:,} conversations merged ({counts.merged_records:,} turn "
            f"records); kept as one row per turn: {sum(counts.merge_fallback.values()):,} ({fallback})"
        )
    if result.directory_errors and options.skip_invalid:
        lines.append(
            f"warning: {result.directory_errors:,} error(s) verify found beyond single records (shard checksum or "
            "count, missing shard, prompt shape); their records were kept. See `eagle-datagen verify-shard "
            f"{source.directory}`"
        )
    report = result.report
    warnings = ", ".join(f"{kind} {n:,}" for kind, n in sorted(report.warnings.items()))
    lines.append(
        f"checked: verify-shard's per-record checks on all {report.records:,} records"
        + (f"; warnings: {warnings}" if warnings else "")
        + f" (the prompt re-render is left to `eagle-datagen verify-shard {source.directory}`)"
    )
    if source.partial_records:
        lines.append(
            f"not read: {source.partial_records:,} records in {', '.join(source.partial_files)} (a run that has not "
            f"finished); `eagle-datagen resume --out {source.directory}` finishes it, then export again"
        )
    return "\n".join(lines)


def export_command(options: ExportOptions) -> int:
    """CLI entry: prints the summary to stderr; 0 on success."""
    result = export(options)
    print(result.summary, file=sys.stderr)
    return 0
