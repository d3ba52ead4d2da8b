"""Throughput of ``export`` per format on a realistic run directory, in-process, on one core.

The run directory is bench_verify's (Kimi-K2.5-sized ids, think tokens, through the real ShardStore and
Manifest). Each format is exported into a fresh directory and timed end to end: verify's per-record checks,
the rows, the writer, export.json. ``checks only`` is the same scan with a sink that drops every record: the
floor set by verify's checks, which every format pays::

    .venv/bin/python scripts/bench_export.py                                  # 100,000 records
    .venv/bin/python scripts/bench_export.py --records 20000 --formats specforge,parquet
    # speculators-dataset needs torch (set_format("torch") is persisted): run it with a torch env, e.g.
    PYTHONPATH=.trainers:tests/sglang_shims:src .venv-sglang/bin/python scripts/bench_export.py \\
        --formats speculators-dataset

MB/s is megabytes of shard read per CPU second of this process (its only thread); rows/s likewise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle_datagen.export.command import ExportOptions, export
from eagle_datagen.export.formats import FORMATS
from eagle_datagen.export.rows import RowOptions
from eagle_datagen.export.source import open_source, scan
from eagle_datagen.store.manifest import Manifest


def time_checks_only(run: Path) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    source = open_source(run)
    result = scan(source, lambda raw, where, problem: None)
    assert result.report.ok
    return time.perf_counter() - wall, time.process_time() - cpu


def time_format(run: Path, fmt: str, out: Path) -> tuple[float, float, int]:
    shutil.rmtree(out, ignore_errors=True)
    options = ExportOptions(run, fmt, out, RowOptions(), progress=False)  # type: ignore[arg-type]
    wall, cpu = time.perf_counter(), time.process_time()
    result = export(options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert result.counts.rows == result.counts.records
    return wall, cpu, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--formats", default="specforge,speculators,parquet", help=f"of {','.join(FORMATS)}")
    parser.add_argument("--dir", type=Path, help="where to write the run directory [a temporary one]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {unknown}")
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-export-"))
    run = base / "run"
    try:
        if not (run / "manifest.json").is_file():
            run.mkdir(parents=True)
            # generated in a child process, so the timed process starts with a clean heap
            subprocess.run(
                [sys.executable, str(Path(__file__).with_name("bench_verify.py")), "--make-only", "--dir", str(run),
                 "--records", str(args.records), "--output-len", str(args.output_len),
                 "--prompt-len", str(args.prompt_len), "--shard-size", str(args.shard_size), "--seed", str(args.seed)],
                check=True,
            )  # fmt: skip
        size = sum(p.stat().st_size for p in (run / "shards").glob("shard_*.jsonl"))
        records = sum(info.records for info in Manifest.load(run).shards)  # finalized shards only
        print(f"run directory: {run}; {records:,} records, {size / 1e6:,.1f} MB of shards; {os.cpu_count()} CPUs")
        wall, cpu = time_checks_only(run)
        print(
            f"{'checks only':<20} wall {wall:6.2f} s  CPU {cpu:6.2f} s  {size / cpu / 1e6:6.1f} MB/s  {records / cpu:8,.0f} rows/s"
        )
        for fmt in formats:
            wall, cpu, written = time_format(run, fmt, base / f"out-{fmt}")
            print(
                f"{fmt:<20} wall {wall:6.2f} s  CPU {cpu:6.2f} s  {size / cpu / 1e6:6.1f} MB/s  "
                f"{records / cpu:8,.0f} rows/s  ({written / 1e6:,.1f} MB written)"
            )
        print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
