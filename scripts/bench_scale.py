"""Inputs at scale and merge, measured side by side in one run (figures: docs/performance.md).

1. Reading prompts: the same N rows as plain JSONL, .jsonl.gz, .jsonl.zst and Parquet through PromptReader
   (parse + validate + key, what `run` does before rendering): rows/s, and the time to the first row.
2. The plan's pin of each input (`PromptSource.identity()`): sha256 of the whole file vs Parquet's footer.
3. `merge` over P partitions of R records each (synthetic finished run directories with .ids sidecars).
4. `--first-request`: spawn `eagle-datagen run` → the first /generate at a fake server, for the JSONL and the
   Parquet input (the whole input is validated before the first request, so this grows with its size).

    .venv/bin/python scripts/bench_scale.py --rows 1000000 --partitions 8 --records 100000
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson


def make_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        if i % 2:
            rows.append({"id": f"p{i}", "prompt": f"question {i}: explain the {i % 97}th idea in three sentences"})
        else:
            rows.append(
                {
                    "id": f"m{i}",
                    "messages": [
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": f"tell me about topic {i} and why it matters"},
                    ],
                }
            )
    return rows


def time_reader(path: Path) -> tuple[float, float, int]:
    from eagle_datagen.inputs.prompts import PromptReader

    started = time.perf_counter()
    first = None
    count = 0
    for _ in PromptReader(path):
        if first is None:
            first = time.perf_counter() - started
        count += 1
    return time.perf_counter() - started, first or 0.0, count


def time_identity(path: Path) -> float:
    from eagle_datagen.inputs.sources import open_source

    started = time.perf_counter()
    open_source(path).identity()
    return time.perf_counter() - started


def bench_inputs(n: int, root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = make_rows(n)
    plain = root / "p.jsonl"
    plain.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    data = plain.read_bytes()
    (root / "p.jsonl.gz").write_bytes(gzip.compress(data, compresslevel=6))
    (root / "p.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
    table = pa.Table.from_pylist(
        [
            {
                "id": r["id"],
                "prompt": r.get("prompt"),
                "messages": orjson.dumps(r["messages"]).decode() if "messages" in r else None,
            }
            for r in rows
        ]
    )
    pq.write_table(table, root / "p.parquet", row_group_size=65536)
    del rows, table
    print(f"rows: {n:,}; plain JSONL {plain.stat().st_size / 1e6:.0f} MB")
    print(f"{'input':<12} {'MB':>7} {'read s':>8} {'rows/s':>10} {'first row s':>12} {'pin s':>7}")
    for name in ("p.jsonl", "p.jsonl.gz", "p.jsonl.zst", "p.parquet"):
        path = root / name
        wall, first, count = time_reader(path)
        assert count == n, (name, count)
        pin = time_identity(path)
        print(
            f"{name:<12} {path.stat().st_size / 1e6:>7.0f} {wall:>8.2f} {count / wall:>10,.0f} {first:>12.3f} {pin:>7.2f}"
        )


def bench_first_request(root: Path, repeat: int) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_client import FakeServer, cpu_cores, tiny_tokenizer, tokenizer_ids
    from bench_memory import first_request_s

    tokenizer = tiny_tokenizer(root)
    vocab, eos = tokenizer_ids(tokenizer)
    _, server_core = cpu_cores()
    with FakeServer({"vocab_size": vocab, "eos_id": eos, "fixed_output_len": 4}, root, server_core) as fake:
        for name in ("p.jsonl", "p.parquet"):
            times = [first_request_s(root / name, tokenizer, fake, root) for _ in range(repeat)]
            print(f"first request, {name}: {', '.join(f'{x:.2f}' for x in times)} s")


def bench_merge(partitions: int, records: int, root: Path) -> None:
    from eagle_datagen.inputs.partition import Partition, partition_of
    from eagle_datagen.inputs.sources import open_source
    from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
    from eagle_datagen.store.shards import ShardInfo, shard_name
    from eagle_datagen.verify.merge import merge_runs

    total = partitions * records
    prompts = root / "merge-prompts.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"id": f"k{i}", "prompt": "x"}) + b"\n" for i in range(total)))
    plan = {"prompts": open_source(prompts).identity(), "samples_per_prompt": 1, "shard_size": 10_000}
    by_part: list[list[str]] = [[] for _ in range(partitions)]
    for i in range(total):
        key = f"k{i}"
        by_part[partition_of(key, partitions)].append(key)
    runs = []
    for index, keys in enumerate(by_part):
        run = root / f"part-{index}"
        shard_dir = run / "shards"
        shard_dir.mkdir(parents=True)
        manifest = Manifest(
            path=run / MANIFEST_NAME, plan={**plan, "partition": Partition(index, partitions).to_json()}
        )
        for s, start in enumerate(range(0, len(keys), 10_000)):
            chunk = keys[start : start + 10_000]
            lines = b"".join(orjson.dumps({"id": k, "prompt_ids": [1], "output_ids": [2]}) + b"\n" for k in chunk)
            (shard_dir / shard_name(s)).write_bytes(lines)
            (shard_dir / shard_name(s)).with_suffix(".ids").write_text("\n".join(chunk) + "\n")
            manifest.shards.append(ShardInfo(shard_name(s), len(chunk), hashlib.sha256(lines).hexdigest()))
        manifest.save()
        runs.append(run)
    started = time.perf_counter()
    report = merge_runs(root / "merged", runs)
    wall = time.perf_counter() - started
    print(
        f"merge: {partitions} partitions x ~{records:,} records = {report.records:,} in {report.shards} shards: "
        f"{wall:.2f} s ({report.records / wall:,.0f} records/s), links"
    )
    shutil.rmtree(root / "merged")
    started = time.perf_counter()
    merge_runs(root / "merged", runs, copy=True)
    print(f"merge --copy: {time.perf_counter() - started:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--first-request", type=int, default=0, metavar="REPEAT", help="measure it REPEAT times")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        bench_inputs(args.rows, root)
        if args.first_request:
            bench_first_request(root, args.first_request)
        bench_merge(args.partitions, args.records, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
