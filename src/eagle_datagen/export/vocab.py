"""``eagle-datagen vocab-map``: the draft vocabulary from the exact output tokens, on a CPU, in one pass.

Counts are over the trained tokens (every ``output_ids`` id, stop token included) of the records that pass
verify's per-record checks and ``--include-finish``. The top N ids are ranked by ``(-count, id)``: most
frequent first, ties to the lower id (speculators' own rule in ``build_vocab_mappings_from_distribution``;
SpecForge's ``Counter.most_common`` keeps first-seen order, which depends on the data's order, so we do not
follow it). With fewer than N distinct ids the map is padded with the lowest unused ids, what both trainers
do. The selected ids, ascending, give ``d2t[i] = selected[i] - i`` (int64) and ``t2d[selected] = True``
(bool, the target vocab size long); ``nonzero(t2d) == d2t + arange(N)`` is checked before anything is
written.
"""

from __future__ import annotations

import io
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from eagle_datagen import __version__
from eagle_datagen.errors import UsageError
from eagle_datagen.export.command import ExportRefused
from eagle_datagen.export.deps import need
from eagle_datagen.export.source import Location, Progress, Source, open_source, parse_record, scan
from eagle_datagen.store.durable import write_atomic
from eagle_datagen.verify.verify import format_report

VocabFormat = Literal["specforge", "speculators"]
COVERAGE_AT = (8192, 16384, 32768, 65536)
COVERAGE_TARGETS = (90, 95, 99)  # percent, as `stats` reports them
REPORT_NAME = "vocab-map.json"
COUNT_BATCH = 1 << 20


@dataclass(frozen=True)
class VocabOptions:
    directory: Path
    draft_vocab_size: int
    fmt: VocabFormat
    out: Path
    target_vocab_size: int | None = None
    include_finish: frozenset[str] = frozenset({"stop", "length"})
    skip_invalid: bool = False
    progress: bool = True


@dataclass
class TokenCounts:
    """Per-id counts of the trained tokens, and what was counted."""

    counts: Any  # numpy int64[target_vocab]
    records: int = 0
    used_records: int = 0
    tokens: int = 0
    left_out: Counter[str] = field(default_factory=Counter)


@dataclass
class VocabMap:
    d2t: Any  # numpy int64[N]
    t2d: Any  # numpy bool[V]
    selected: Any  # numpy int64[N], ascending
    distinct: int
    padded: int


def target_vocab_size(source: Source, given: int | None) -> int:
    if given is not None:
        return given
    facts = source.manifest.facts
    for name in ("model_vocab_size", "vocab_size"):
        value = facts.get(name)
        if type(value) is int and value > 0:
            return value
    raise UsageError(
        f"{source.manifest.path} records no vocab size (facts.model_vocab_size); pass --target-vocab-size "
        "(the target model's config.json vocab_size)"
    )


def count_tokens(source: Source, vocab: int, options: VocabOptions) -> TokenCounts:
    """One pass over the shards: verify's checks per record, the output ids counted with ``bincount``."""
    np = need("numpy", "vocab-map")
    result = TokenCounts(counts=np.zeros(vocab, dtype=np.int64))
    buffer: list[int] = []

    def flush() -> None:
        if not buffer:
            return
        ids = np.asarray(buffer, dtype=np.int64)
        if int(ids.max()) >= vocab:
            raise UsageError(
                f"output id {int(ids.max())} is outside the target vocabulary [0, {vocab}); "
                "--target-vocab-size is smaller than the model's"
            )
        result.counts += np.bincount(ids, minlength=vocab)
        buffer.clear()

    def take(raw: bytes, where: Location, problem: str | None) -> None:
        result.records += 1
        if problem is not None:
            result.left_out[f"invalid_{problem}"] += 1
            return
        record = parse_record(raw)
        if record.finish not in options.include_finish:
            result.left_out[f"finish_{record.finish}"] += 1
            return
        result.used_records += 1
        result.tokens += record.output_len
        buffer.extend(record.output_ids())
        if len(buffer) >= COUNT_BATCH:
            flush()

    bar = Progress(source.total_bytes, options.progress, "vocab-map: counting")
    try:
        scanned = scan(source, take, on_bytes=bar.update)
    finally:
        bar.close()
    if not scanned.report.ok and not options.skip_invalid:
        raise ExportRefused(
            f"{source.directory} has records or shards that verify-shard rejects; no map was written.\n"
            + format_report(scanned.report)
            + "\nFix the directory, or pass --skip-invalid to leave the failing records out (counted)."
        )
    flush()
    return result


def build_map(counts: Any, draft_vocab_size: int) -> VocabMap:
    """The top ``draft_vocab_size`` ids by ``(-count, id)``, padded with the lowest unused ids."""
    np = need("numpy", "vocab-map")
    vocab = len(counts)
    if draft_vocab_size > vocab:
        raise UsageError(f"--draft-vocab-size {draft_vocab_size} is larger than the target vocabulary ({vocab})")
    seen = np.flatnonzero(counts)
    ranked = seen[np.lexsort((seen, -counts[seen]))]
    top = ranked[:draft_vocab_size]
    padded = draft_vocab_size - len(top)
    if padded:
        unused = np.ones(vocab, dtype=bool)
        unused[top] = False
        top = np.concatenate([top, np.flatnonzero(unused)[:padded]])
    selected = np.sort(top).astype(np.int64)
    d2t = selected - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[selected] = True
    if not np.array_equal(np.flatnonzero(t2d), d2t + np.arange(draft_vocab_size)):  # the trainers' own invariant
        raise AssertionError("nonzero(t2d) != d2t + arange(N)")
    return VocabMap(d2t=d2t, t2d=t2d, selected=selected, distinct=len(seen), padded=padded)


def coverage(counts: Any, draft_vocab_size: int) -> dict[str, Any]:
    """Share of trained tokens the top k ids cover (k = 8k/16k/32k/64k and N), and the k for 90/95/99 %.

    The same numbers as ``stats``' coverage section (same tops, same integer rule)."""
    np = need("numpy", "vocab-map")
    total = int(counts.sum())
    cumulative = np.cumsum(np.sort(counts)[::-1])
    vocab = len(counts)

    def share(k: int) -> float:
        return float(cumulative[min(k, vocab) - 1]) / total if total else 0.0

    return {
        "tokens": total,
        "distinct_ids": int(np.count_nonzero(counts)),
        "top_k_share": {str(k): round(share(k), 6) for k in (*COVERAGE_AT, draft_vocab_size)},
        # the smallest k with cumulative[k-1] / total >= q %, in integers (the rule `stats` uses)
        "ids_for_share": {
            str(q): (int(np.searchsorted(cumulative * 100, q * total, side="left")) + 1 if total else 0)
            for q in COVERAGE_TARGETS
        },
    }


def _bytes_of(save: Any, obj: Any) -> bytes:
    buffer = io.BytesIO()
    save(buffer, obj)
    return buffer.getvalue()


def write_map(vmap: VocabMap, counts: Any, options: VocabOptions) -> list[str]:
    """The trainer's files in ``--out`` (each replaced atomically); returns their names."""
    np = need("numpy", "vocab-map")
    torch = need("torch", f"vocab-map --format {options.fmt} (it writes .pt files)")
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    n = options.draft_vocab_size
    if options.fmt == "specforge":
        name = f"vocab_mapping_{n}.pt"
        mapping = {"d2t": torch.from_numpy(vmap.d2t.copy()), "t2d": torch.from_numpy(vmap.t2d.copy())}
        write_atomic(out / name, _bytes_of(lambda f, o: torch.save(o, f), mapping))
        return [name]
    names = [f"d2t-{n}.npy", f"t2d-{n}.npy", "token_freq.pt"]
    write_atomic(out / names[0], _bytes_of(np.save, vmap.d2t))
    write_atomic(out / names[1], _bytes_of(np.save, vmap.t2d))
    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    write_atomic(out / names[2], _bytes_of(lambda f, o: torch.save(o, f), freq))
    return names


def vocab_map(options: VocabOptions) -> dict[str, Any]:
    """Counts, builds, writes; returns the report (also written as ``--out/vocab-map.json``)."""
    started = time.perf_counter()
    source = open_source(options.directory)
    vocab = target_vocab_size(source, options.target_vocab_size)
    if options.draft_vocab_size > vocab:
        raise UsageError(
            f"--draft-vocab-size {options.draft_vocab_size} is larger than the target vocabulary ({vocab})"
        )
    need("numpy", "vocab-map")
    need("torch", f"vocab-map --format {options.fmt} (it writes .pt files)")
    counted = count_tokens(source, vocab, options)
    if counted.tokens == 0:
        left = ", ".join(f"{k} {n:,}" for k, n in sorted(counted.left_out.items())) or "no records"
        raise ExportRefused(f"no output token to count in {counted.records:,} records ({left}); no map was written")
    vmap = build_map(counted.counts, options.draft_vocab_size)
    files = write_map(vmap, counted.counts, options)
    report = {
        "format": 1,
        "tool_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "map_format": options.fmt,
        "files": files,
        "source": {
            "directory": str(source.directory.resolve()),
            "plan_sha256": source.plan_sha256,
            "partial_records_not_read": source.partial_records,
        },
        "draft_vocab_size": options.draft_vocab_size,
        "target_vocab_size": vocab,
        "tie_rule": "(-count, id): most frequent first, ties to the lower id",
        "distinct_ids": vmap.distinct,
        "padded_ids": vmap.padded,
        "padding_rule": "the lowest ids not already selected (what SpecForge and speculators do)",
        "records_read": counted.records,
        "records_counted": counted.used_records,
        "left_out": dict(sorted(counted.left_out.items())),
        "coverage": coverage(counted.counts, options.draft_vocab_size),
        "wall_s": round(time.perf_counter() - started, 3),
    }
    write_atomic(options.out / REPORT_NAME, orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    return report


def format_vocab_summary(report: dict[str, Any], options: VocabOptions) -> str:
    cov = report["coverage"]
    n = options.draft_vocab_size
    shares = ", ".join(f"top {int(k):,}: {v:.2%}" for k, v in cov["top_k_share"].items())
    needed = ", ".join(f"{q} % → {k:,}" for q, k in cov["ids_for_share"].items())
    lines = [
        f"vocab map N={n:,} of {report['target_vocab_size']:,} ids from {cov['tokens']:,} output tokens "
        f"({report['records_counted']:,} records) → {options.out}: {', '.join(report['files'])} + {REPORT_NAME}",
        f"coverage: {shares}",
        f"ids needed: {needed}",
    ]
    if report["padded_ids"]:
        lines.append(
            f"note: only {report['distinct_ids']:,} distinct ids were seen; the map is padded with the "
            f"{report['padded_ids']:,} lowest unused ids (as the trainers pad)"
        )
    if report["left_out"]:
        lines.append("left out: " + ", ".join(f"{k} {v:,}" for k, v in report["left_out"].items()))
    if options.fmt == "speculators":
        lines.append(
            f"speculators looks for d2t-{n}.npy / t2d-{n}.npy in --data-path: train with --data-path {options.out} "
            f"--draft-vocab-size {n}, or pass --d2t-path/--t2d-path"
        )
    else:
        lines.append(f"SpecForge: set model.vocab_mapping_path={options.out / report['files'][0]}")
    return "\n".join(lines)


def vocab_map_command(options: VocabOptions) -> int:
    report = vocab_map(options)
    print(format_vocab_summary(report, options), file=sys.stderr)
    return 0
