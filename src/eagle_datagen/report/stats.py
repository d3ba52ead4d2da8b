"""``eagle-datagen stats``: what a data set holds, in one streaming pass over its shards.

Counts by finish reason, variant, turn and server; output and prompt lengths (p50/p90/p99/max, in tokens);
the share that hit ``max_new_tokens``; reasoning (tokens before think-close) and answer lengths; empty
answers; tool-call turns; draft-vocabulary coverage of the output ids; throughput over time and per server
(from the records' ``started``/``finished`` stamps).

Speed (docs/performance.md, ``scripts/bench_stats.py``): the id lists are never turned into Python ints.
A record line is cut at its ``prompt_ids`` and ``output_ids`` lists (``bytes.find``); lengths are comma
counts, think/tool ids are found with ``bytes.find`` over the output's bytes, the small fields around the
lists go through orjson, and the output bytes of many records are parsed at once by NumPy
(``np.fromstring(..., sep=",")``) into a ``bincount`` for the coverage. A line in any other layout takes the
slow path (``orjson.loads`` of the whole line) and gives the same numbers.

A live run: only complete lines (ending in a newline) are read, and the report says so.
"""

from __future__ import annotations

import array
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from eagle_datagen.errors import UsageError
from eagle_datagen.record.tally import NO_VARIANT, Tally
from eagle_datagen.report.markers import Markers, run_markers
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.store.shards import SHARD_RE

SHARDS_DIR = "shards"
PERCENTILES = (50, 90, 99)
COVERAGE_TOPS = (8192, 16384, 32768, 65536)
#: Percent of output tokens the smallest top-N must cover.
COVERAGE_TARGETS = (90, 95, 99)
THROUGHPUT_BINS = 60
#: Output bytes gathered before one NumPy parse (bounded memory, amortized call cost).
PARSE_BATCH_BYTES = 1 << 23
READ_BUFFER = 1 << 20
COVERAGE_CURVE_POINTS = 400

_PROMPT_KEY = b'"prompt_ids":['
_BETWEEN = b'],"output_ids":['
_NOT_ID_CHARS = (b"-", b".", b"e", b"E", b'"', b"[", b"{", b"n")
_ID_BEFORE = frozenset(b"[, ")
_ID_AFTER = frozenset(b"], ")
_COMMA = ord(",")

IntArray = npt.NDArray[np.int64]


def percentiles(values: Sequence[int] | npt.NDArray[Any]) -> dict[str, int]:
    """Nearest-rank p50/p90/p99 and the max (the value at rank ``ceil(p/100 · n)``); zeros when empty."""
    data = np.sort(np.asarray(values, dtype=np.int64))
    n = len(data)
    if n == 0:
        return {**{f"p{p}": 0 for p in PERCENTILES}, "max": 0}
    out = {f"p{p}": int(data[max(0, -(-p * n // 100) - 1)]) for p in PERCENTILES}
    out["max"] = int(data[-1])
    return out


@dataclass
class Shape:
    """How one output divides: reasoning tokens, answer tokens, whether (and where) a tool call starts."""

    reasoning: int
    closed: bool
    answer: int
    tool_call: bool


def split_output(
    output_len: int,
    close_at: int | None,
    tool_at: int | None,
    *,
    opens_reasoning: bool,
    ends_on_stop_id: bool,
) -> Shape:
    """The one rule for reasoning/answer lengths (``stats`` and ``show``).

    Reasoning is the ids before think-close; without a think-close it is the whole output when the prompt
    opened reasoning (up to a tool call or the stop id: cut by ``max_new_tokens``, or never closed), else nothing.
    The answer runs from after think-close to the first tool-call id, or to the end less the stop id."""
    end = output_len - (1 if ends_on_stop_id else 0)
    if close_at is not None:
        reasoning, start = close_at, close_at + 1
    elif opens_reasoning:
        reasoning = tool_at if tool_at is not None else end
        start = reasoning
    else:
        reasoning, start = 0, 0
    tool = tool_at is not None and tool_at >= start
    if tool:
        assert tool_at is not None
        end = tool_at
    return Shape(reasoning=reasoning, closed=close_at is not None, answer=max(0, end - start), tool_call=tool)


@dataclass
class Group:
    """Per-variant series: lengths for percentiles and histograms."""

    output: array.array[int] = field(default_factory=lambda: array.array("q"))
    prompt: array.array[int] = field(default_factory=lambda: array.array("q"))
    reasoning_tokens: int = 0
    length: int = 0


@dataclass
class ShardRead:
    name: str
    records: int
    bytes: int
    partial: bool
    skipped_tail: bool


@dataclass
class StatsReport:
    """Everything ``stats`` computed; :meth:`to_json` for machines, :func:`format_stats` for people, and the
    series (lengths per variant, the coverage curve, throughput bins) for the plots."""

    directory: str
    tally: Tally
    shards: list[ShardRead]
    bytes: int
    elapsed_s: float
    live: bool
    notes: list[str]
    turns: Counter[str]
    prompt_lengths: dict[str, int]
    output_lengths: dict[str, int]
    by_variant: dict[str, dict[str, Any]]
    reasoning: dict[str, Any]
    answer: dict[str, Any]
    tool_call_turns: int
    coverage: dict[str, Any]
    throughput: dict[str, Any]
    variant_outputs: dict[str, IntArray]
    coverage_curve: list[tuple[int, float]]
    markers: Markers

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.elapsed_s / 1e6 if self.elapsed_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        t = self.tally
        return {
            "directory": self.directory,
            "records": t.records,
            "bytes": self.bytes,
            "elapsed_s": round(self.elapsed_s, 3),
            "mb_per_s": round(self.mb_per_s, 1),
            "live": self.live,
            "notes": self.notes,
            "shards": [vars(s) for s in self.shards],
            "finish": dict(sorted(t.finish.items())),
            "variants": dict(sorted(t.variants.items())),
            "turns": dict(sorted(self.turns.items())),
            "servers": dict(sorted(t.servers.items())),
            "hit_max_new_tokens": {"count": t.hit_length, "share": _share(t.hit_length, t.records)},
            "output_tokens": {"total": t.output_tokens, "mean": round(t.mean_output, 3), **self.output_lengths},
            "prompt_tokens": self.prompt_lengths,
            "by_variant": self.by_variant,
            "reasoning": self.reasoning,
            "answer": self.answer,
            "tool_call_turns": self.tool_call_turns,
            "coverage": self.coverage,
            "throughput": self.throughput,
        }


def _share(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0


class Collector:
    """Streams record lines; :meth:`report` turns what it saw into a :class:`StatsReport`."""

    def __init__(self, markers: Markers, vocab_size: int | None) -> None:
        self.markers = markers
        self.tally = Tally()
        self.turns: Counter[str] = Counter()
        self.groups: dict[str, Group] = {}
        self.counts: IntArray = np.zeros(vocab_size or 1, dtype=np.int64)
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.reasoning_tokens = 0
        self.reasoning_records = 0
        self.unclosed = 0
        self.reasoning_lengths = array.array("q")
        self.answer_lengths = array.array("q")
        self.empty_answers = 0
        self.tool_calls = 0
        self.started = array.array("d")
        self.finished = array.array("d")
        self.timed_tokens = array.array("q")
        self.timed_servers: list[str] = []
        self.untimed = 0
        self.bad_lines = 0
        close = markers.think_close
        self._close_text = b"%d" % close if close is not None else None
        self._tool_texts = [(b"%d" % i) for i in sorted(markers.tool_calls)]

    # --- per line ------------------------------------------------------------------------------------

    def add_line(self, raw: bytes) -> None:
        """One complete record line (ending in a newline)."""
        if not self._fast(raw):
            self._slow(raw)

    def _fast(self, raw: bytes) -> bool:
        find = raw.find
        at = find(_PROMPT_KEY)
        if at < 1:
            return False
        s1 = at + len(_PROMPT_KEY)
        e1 = find(b"]", s1)
        if e1 < 0 or not raw.startswith(_BETWEEN, e1):
            return False
        s2 = e1 + len(_BETWEEN)
        e2 = find(b"]", s2)
        if e2 <= s2 or e1 <= s1:
            return False
        for char in _NOT_ID_CHARS:  # memchr passes: anything but non-negative ints goes the slow way
            if find(char, s2, e2) >= 0 or find(char, s1, e1) >= 0:
                return False
        try:
            head = orjson.loads(raw[: at - 1] + b"}") if at > 1 else {}
            tail = raw[e2 + 1 :].rstrip()
            rest = orjson.loads(b"{" + tail[1:]) if tail.startswith(b",") else orjson.loads(b"{" + tail)
        except orjson.JSONDecodeError:
            return False
        if type(head) is not dict or type(rest) is not dict:
            return False
        # comma counts through NumPy (vectorized compares) run ~3x faster than bytes.count
        chars = np.frombuffer(raw, dtype=np.uint8)
        prompt_len = int(np.count_nonzero(chars[s1:e1] == _COMMA)) + 1
        output_len = int(np.count_nonzero(chars[s2:e2] == _COMMA)) + 1
        tail_ids = [int(x) for x in raw[max(s1, e1 - 64) : e1].split(b",")[1 if e1 - 64 > s1 else 0 :][-4:]]
        close_at = self._find_id(raw, self._close_text, s2, e2)
        tool_at = None
        for text in self._tool_texts:
            found = self._find_id(raw, text, s2, e2)
            if found is not None and (tool_at is None or found < tool_at):
                tool_at = found
        last = int(raw[raw.rfind(b",", s2, e2) + 1 if output_len > 1 else s2 : e2])
        self.pending.append(raw[s2:e2])
        self.pending_bytes += e2 - s2
        if self.pending_bytes >= PARSE_BATCH_BYTES:
            self._flush()
        self._account({**head, **rest}, prompt_len, output_len, tail_ids, close_at, tool_at, last)
        return True

    @staticmethod
    def _find_id(raw: bytes, text: bytes | None, start: int, end: int) -> int | None:
        """The index (in the list) of the first whole id ``text`` between ``start`` and ``end``."""
        if text is None:
            return None
        at = raw.find(text, start, end)
        while at >= 0:
            after = at + len(text)
            if (at == start or raw[at - 1] in _ID_BEFORE) and (after == end or raw[after] in _ID_AFTER):
                return raw.count(b",", start, at)
            at = raw.find(text, after, end)
        return None

    def _slow(self, raw: bytes) -> None:
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.bad_lines += 1
            return
        prompt = record.get("prompt_ids") if type(record) is dict else None
        output = record.get("output_ids") if type(record) is dict else None
        if not (isinstance(prompt, list) and isinstance(output, list) and output):
            self.bad_lines += 1
            return
        if not all(type(i) is int and i >= 0 for i in output) or not all(type(i) is int for i in prompt[-4:]):
            self.bad_lines += 1
            return
        close = self.markers.think_close
        close_at = output.index(close) if close is not None and close in output else None
        tool_at = min((output.index(t) for t in self.markers.tool_calls if t in output), default=None)
        self._add_counts(np.asarray(output, dtype=np.int64))
        self._account(record, len(prompt), len(output), prompt[-4:], close_at, tool_at, output[-1])

    def _account(
        self,
        fields: dict[str, Any],
        prompt_len: int,
        output_len: int,
        prompt_tail: list[int],
        close_at: int | None,
        tool_at: int | None,
        last_id: int,
    ) -> None:
        finish = fields.get("finish_reason")
        finish_type = str(finish.get("type")) if isinstance(finish, dict) else "unknown"
        matched = finish.get("matched") if isinstance(finish, dict) else None
        server = fields.get("server")
        server = server if isinstance(server, str) else None
        variant = fields.get("variant")
        variant = variant if isinstance(variant, str) else None
        self.tally.add(output_len, finish_type, server=server, variant=variant)
        turn = fields.get("turn")
        self.turns[str(turn) if turn is not None else "0"] += 1
        shape = split_output(
            output_len,
            close_at,
            tool_at,
            opens_reasoning=self.markers.prompt_opens_reasoning(prompt_tail),
            ends_on_stop_id=finish_type == "stop" and type(matched) is int and matched == last_id,
        )
        group = self.groups.get(variant or NO_VARIANT)
        if group is None:
            group = self.groups[variant or NO_VARIANT] = Group()
        group.output.append(output_len)
        group.prompt.append(prompt_len)
        group.reasoning_tokens += shape.reasoning
        group.length += finish_type == "length"
        if shape.reasoning:
            self.reasoning_records += 1
            self.reasoning_tokens += shape.reasoning
            self.reasoning_lengths.append(shape.reasoning)
            self.unclosed += not shape.closed
        self.answer_lengths.append(shape.answer)
        self.tool_calls += shape.tool_call
        self.empty_answers += finish_type == "stop" and shape.answer == 0 and not shape.tool_call
        started, finished = fields.get("started"), fields.get("finished")
        if isinstance(started, (int, float)) and isinstance(finished, (int, float)):
            self.started.append(float(started))
            self.finished.append(float(finished))
            self.timed_tokens.append(output_len)
            self.timed_servers.append(server or "?")
        else:
            self.untimed += 1

    # --- coverage ------------------------------------------------------------------------------------

    def _flush(self) -> None:
        if not self.pending:
            return
        ids = np.fromstring(b",".join(self.pending), dtype=np.int32, sep=",")  # int32 parses ~15 % faster
        self.pending.clear()
        self.pending_bytes = 0
        self._add_counts(ids)

    def _add_counts(self, ids: npt.NDArray[np.integer[Any]]) -> None:
        if not len(ids):
            return
        binned = np.bincount(ids)
        if len(binned) > len(self.counts):
            grown = np.zeros(len(binned), dtype=np.int64)
            grown[: len(self.counts)] = self.counts
            self.counts = grown
        self.counts[: len(binned)] += binned

    # --- the report ----------------------------------------------------------------------------------

    def report(self, directory: str, shards: list[ShardRead], elapsed_s: float, live: bool) -> StatsReport:
        self._flush()
        t = self.tally
        notes = []
        if live:
            notes.append(
                "a run is writing here (or was killed): only complete lines were read; the numbers grow as it goes"
            )
        for shard in shards:
            if shard.skipped_tail:
                notes.append(f"{shard.name}: its last line is incomplete (being written, or torn): not read")
        if self.bad_lines:
            notes.append(f"{self.bad_lines:,} line(s) are not records (run verify-shard): left out")
        if self.untimed:
            notes.append(f"{self.untimed:,} record(s) have no started/finished stamps: not in the throughput")
        if self.markers.think_close is None:
            notes.append("the tokenizer has no think-close token: reasoning is not measured")
        variant_outputs = {k: np.frombuffer(g.output, dtype=np.int64) for k, g in sorted(self.groups.items())}
        all_out = np.concatenate(list(variant_outputs.values())) if variant_outputs else np.zeros(0, np.int64)
        all_prompt = np.concatenate([np.frombuffer(g.prompt, np.int64) for g in self.groups.values()] or [all_out])
        by_variant = {
            name: {
                "records": len(g.output),
                "output_tokens": {"total": int(sum(g.output)), **percentiles(g.output)},
                "prompt_tokens": percentiles(g.prompt),
                "hit_max_new_tokens": _share(g.length, len(g.output)),
                "reasoning_share": _share(g.reasoning_tokens, int(sum(g.output))),
            }
            for name, g in sorted(self.groups.items())
        }
        coverage, curve = self._coverage()
        return StatsReport(
            directory=directory,
            tally=t,
            shards=shards,
            bytes=sum(s.bytes for s in shards),
            elapsed_s=elapsed_s,
            live=live,
            notes=notes,
            turns=self.turns,
            prompt_lengths=percentiles(all_prompt),
            output_lengths=percentiles(all_out),
            by_variant=by_variant,
            reasoning={
                "records": self.reasoning_records,
                "unclosed": self.unclosed,
                "tokens": self.reasoning_tokens,
                "share": _share(self.reasoning_tokens, t.output_tokens),
                "length": percentiles(self.reasoning_lengths),
            },
            answer={"length": percentiles(self.answer_lengths), "empty": self.empty_answers},
            tool_call_turns=self.tool_calls,
            coverage=coverage,
            throughput=self._throughput(),
            variant_outputs=variant_outputs,
            coverage_curve=curve,
            markers=self.markers,
        )

    def _coverage(self) -> tuple[dict[str, Any], list[tuple[int, float]]]:
        counts = np.sort(self.counts[self.counts > 0])[::-1]
        total = int(counts.sum())
        if total == 0:
            return {"tokens": 0, "distinct_ids": 0, "top": {}, "ids_for": {}}, []
        cumulative = np.cumsum(counts)
        top = {str(k): round(int(cumulative[min(k, len(counts)) - 1]) / total, 6) for k in COVERAGE_TOPS}
        # the smallest N with cumulative[N-1] / total >= q %, in integers (no float edge)
        ids_for = {str(q): int(np.searchsorted(cumulative * 100, q * total, side="left")) + 1 for q in COVERAGE_TARGETS}
        points = np.unique(np.geomspace(1, len(counts), num=COVERAGE_CURVE_POINTS).astype(np.int64))
        curve = [(int(n), float(cumulative[n - 1]) / total) for n in points]
        return {"tokens": total, "distinct_ids": len(counts), "top": top, "ids_for": ids_for}, curve

    def _throughput(self) -> dict[str, Any]:
        if not len(self.finished):
            return {"span_s": 0.0, "tok_s": 0.0, "bins": [], "per_server": {}}
        started = np.frombuffer(self.started, dtype=np.float64)
        finished = np.frombuffer(self.finished, dtype=np.float64)
        tokens = np.frombuffer(self.timed_tokens, dtype=np.int64)
        first, last = float(started.min()), float(finished.max())
        span = max(last - first, 1e-3)
        width = span / THROUGHPUT_BINS
        where = np.minimum(((finished - first) / width).astype(np.int64), THROUGHPUT_BINS - 1)
        per_bin = np.bincount(where, weights=tokens, minlength=THROUGHPUT_BINS)
        records = np.bincount(where, minlength=THROUGHPUT_BINS)
        bins = [
            {"start_s": round(i * width, 3), "tok_s": round(float(per_bin[i]) / width, 1), "records": int(records[i])}
            for i in range(THROUGHPUT_BINS)
        ]
        per_server: dict[str, Any] = {}
        servers = np.array(self.timed_servers)
        for url in sorted(set(self.timed_servers)):
            mask = servers == url
            s_first, s_last = float(started[mask].min()), float(finished[mask].max())
            s_tokens = int(tokens[mask].sum())
            latency = finished[mask] - started[mask]
            per_server[url] = {
                "records": int(mask.sum()),
                "output_tokens": s_tokens,
                "span_s": round(s_last - s_first, 3),
                "tok_s": round(s_tokens / max(s_last - s_first, 1e-3), 1),
                "latency_s": {"mean": round(float(latency.mean()), 3), "max": round(float(latency.max()), 3)},
            }
        return {
            "first": round(first, 3),
            "span_s": round(span, 3),
            "tok_s": round(float(tokens.sum()) / span, 1),
            "bin_s": round(width, 3),
            "bins": bins,
            "per_server": per_server,
        }


# --- reading a run -----------------------------------------------------------------------------------------


def shard_files(run_dir: Path) -> list[tuple[Path, bool]]:
    """``(path, partial)`` of every shard under ``run_dir/shards``, in shard order."""
    directory = run_dir / SHARDS_DIR
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p, bool(m.group(2))) for p in directory.iterdir() if (m := SHARD_RE.match(p.name))]
    return [(p, partial) for _, p, partial in sorted(found)]


def open_run(run_dir: Path) -> Manifest:
    if not (run_dir / MANIFEST_NAME).is_file():
        raise UsageError(
            f"{run_dir} has no {MANIFEST_NAME}: give the --out directory of an eagle-datagen run "
            "(the one holding manifest.json and shards/)"
        )
    return Manifest.load(run_dir)


def is_live(manifest: Manifest) -> bool:
    """The last run entry has no ``finished`` stamp: it is still writing, or it was killed."""
    return bool(manifest.runs) and "finished" not in manifest.runs[-1]


def collect(run_dir: Path, *, tokenizer: Path | None = None) -> StatsReport:
    """One pass over the run's shards."""
    began = time.perf_counter()
    manifest = open_run(run_dir)
    markers = run_markers(manifest.plan, manifest.facts, tokenizer)
    vocab = manifest.facts.get("model_vocab_size") or manifest.facts.get("vocab_size")
    collector = Collector(markers, vocab if type(vocab) is int else None)
    reads: list[ShardRead] = []
    for path, partial in shard_files(run_dir):
        records = 0
        skipped = False
        with path.open("rb", buffering=READ_BUFFER) as handle:
            for raw in handle:
                if raw.endswith(b"\n"):
                    collector.add_line(raw)
                    records += 1
                else:
                    skipped = True
            size = handle.tell()
        reads.append(ShardRead(path.name, records, size, partial, skipped))
    live = is_live(manifest)
    return collector.report(str(run_dir), reads, time.perf_counter() - began, live)


# --- text ------------------------------------------------------------------------------------------------


def _pct(values: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in values.items())


def format_stats(report: StatsReport) -> str:
    """The human report."""
    t = report.tally
    partial = sum(1 for s in report.shards if s.partial)
    lines = [
        f"{report.directory}: {t.records:,} records in {len(report.shards)} shard file(s)"
        + (f" ({partial} still being written)" if partial else "")
        + f", {report.bytes / 1e6:,.1f} MB read in {report.elapsed_s:.2f} s ({report.mb_per_s:,.0f} MB/s)",
    ]
    lines += [f"note: {n}" for n in report.notes]
    lines += t.summary_lines()
    lines.append(f"output length (tokens): {_pct(report.output_lengths)}")
    lines.append(f"prompt length (tokens): {_pct(report.prompt_lengths)}")
    if len(report.by_variant) > 1 or NO_VARIANT not in report.by_variant:
        for name, v in report.by_variant.items():
            lines.append(
                f"  variant {name}: {v['records']:,} records; output {_pct(v['output_tokens'])}; "
                f"{100 * v['hit_max_new_tokens']:.1f} % hit max_new_tokens; "
                f"reasoning {100 * v['reasoning_share']:.1f} % of its tokens"
            )
    if len(report.turns) > 1 or "0" not in report.turns:
        lines.append("turns: " + ", ".join(f"{k} {v:,}" for k, v in sorted(report.turns.items())))
    r = report.reasoning
    if report.markers.think_close is not None:
        lines.append(
            f"reasoning: {100 * r['share']:.1f} % of output tokens, in {r['records']:,} records "
            f"({r['unclosed']:,} never closed); length {_pct(r['length'])}"
        )
    a = report.answer
    lines.append(f"answer length (tokens): {_pct(a['length'])}; empty answers: {a['empty']:,}")
    lines.append(f"tool-call turns: {report.tool_call_turns:,}")
    c = report.coverage
    if c.get("tokens"):
        tops = ", ".join(f"top {int(k) // 1024}k {100 * v:.1f} %" for k, v in c["top"].items())
        needs = ", ".join(f"{q} % {n:,}" for q, n in c["ids_for"].items())
        lines.append(f"draft vocabulary: {c['distinct_ids']:,} distinct output ids; {tops}")
        lines.append(f"  ids needed to cover: {needs}")
    tp = report.throughput
    if tp.get("bins"):
        peak = max(b["tok_s"] for b in tp["bins"])
        lines.append(
            f"throughput: {tp['tok_s']:,.0f} output tok/s over {tp['span_s']:,.1f} s (peak {peak:,.0f} tok/s "
            f"in {tp['bin_s']:,.1f} s bins)"
        )
        for url, s in tp["per_server"].items():
            lines.append(
                f"  {url}: {s['records']:,} records, {s['tok_s']:,.0f} tok/s, "
                f"latency mean {s['latency_s']['mean']:,.2f} s, max {s['latency_s']['max']:,.2f} s"
            )
    return "\n".join(lines)


def stats_command(
    directory: Path,
    *,
    as_json: bool,
    html: Path | None = None,
    plots: Path | None = None,
    tokenizer: Path | None = None,
) -> int:
    """``eagle-datagen stats``: prints the report (text or ``--json``), writes ``--plots`` and ``--html``."""
    report = collect(directory, tokenizer=tokenizer)
    written: list[str] = []
    if html is not None or plots is not None:
        from eagle_datagen.report.plots import render_pngs, write_plots

        pngs = render_pngs(report)
        if plots is not None:
            written += [str(p) for p in write_plots(pngs, plots)]
        if html is not None:
            from eagle_datagen.report.html import render_html

            try:
                html.write_text(render_html(report, pngs), encoding="utf-8")
            except OSError as exc:
                raise UsageError(f"cannot write --html {html}: {exc.strerror or exc}") from exc
            written.append(str(html))
    if as_json:
        print(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_stats(report))
    if written:
        print("wrote " + ", ".join(written), file=sys.stderr)
    return 0
