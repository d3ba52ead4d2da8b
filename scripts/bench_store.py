"""What it costs to hand every record to the kernel when it is accepted (review 2026-12 D2).

Compares, for records of three sizes, on the file system of ``--dir``:

``buffered``    0.1's write path: lines collect in a 1 MiB user-space buffer, ``os.write`` when it is full,
                fsync every ``--checkpoint-records``; a kill -9 loses what sits in the buffer.
``per-record``  today's ``ShardStore.append``: one ``os.write`` per record (the line is in the kernel when
                ``append`` returns), fsync every ``--checkpoint-records`` through ``ShardStore.checkpoint``.

For scale it also times ``orjson.dumps`` of the same record, which the pipeline pays once per record anyway.
Each figure is the best of ``--repeat`` passes of ``--records`` appends into a fresh directory.

    .venv/bin/python scripts/bench_store.py --records 20000 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import orjson

from eagle_datagen.store.shards import ShardStore

SIZES = {"small (100+100 ids)": (100, 100), "typical (1k+1k ids)": (1000, 1000), "long (2k+16k ids)": (2000, 16000)}


def record(i: int, prompt: int, output: int, rng: random.Random) -> bytes:
    body = {
        "id": f"row-{i:08d}",
        "key": f"row-{i:08d}",
        "sample": 0,
        "prompt_ids": [rng.randrange(160_000) for _ in range(prompt)],
        "output_ids": [rng.randrange(160_000) for _ in range(output)],
        "finish_reason": {"type": "stop", "matched": 163586},
        "completion_tokens": output,
    }
    return orjson.dumps(body) + b"\n"


def buffered(directory: Path, lines: list[bytes], checkpoint: int) -> float:
    """0.1's ShardStore.append (WRITE_BUFFER_BYTES = 1 MiB), with its sha256 and id bookkeeping."""
    fd = os.open(directory / "shard_00000.jsonl.partial", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    buffer = bytearray()
    digest = hashlib.sha256()
    ids: list[str] = []
    done: set[str] = set()
    t0 = time.perf_counter()
    for n, line in enumerate(lines, 1):
        rid = f"row-{n:08d}"
        if rid in done:
            continue
        buffer += line
        digest.update(line)
        ids.append(rid)
        done.add(rid)
        if len(buffer) >= 1 << 20:
            os.write(fd, buffer)
            buffer.clear()
        if n % checkpoint == 0:
            os.write(fd, buffer)
            buffer.clear()
            os.fsync(fd)
    os.write(fd, buffer)
    os.fsync(fd)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return elapsed


def per_record(directory: Path, lines: list[bytes], checkpoint: int) -> float:
    store = ShardStore(directory, len(lines) + 1, lambda info: None)
    store.open({})
    t0 = time.perf_counter()
    for n, line in enumerate(lines, 1):
        store.append(f"row-{n:08d}", line)
        if n % checkpoint == 0:
            store.checkpoint()
    store.checkpoint()
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--checkpoint-records", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write [%(default)s]")
    args = parser.parse_args()
    rng = random.Random(0)
    print(
        f"{args.records} records per pass, best of {args.repeat}, fsync every {args.checkpoint_records}, in {args.dir}"
    )
    print(f"{'record size':<22}{'bytes':>8}{'buffered µs':>13}{'per-record µs':>15}{'extra µs':>10}{'orjson µs':>11}")
    for label, (prompt, output) in SIZES.items():
        count = args.records if output < 10_000 else max(1, args.records // 10)
        distinct = [record(i, prompt, output, rng) for i in range(min(count, 200))]
        lines = [distinct[i % len(distinct)] for i in range(count)]
        sample = orjson.loads(lines[0])
        t0 = time.perf_counter()
        for _ in range(200):
            orjson.dumps(sample)
        dumps_us = (time.perf_counter() - t0) / 200 * 1e6
        best = {"buffered": float("inf"), "per-record": float("inf")}
        for _ in range(args.repeat):
            for name, fn in (("buffered", buffered), ("per-record", per_record)):
                directory = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
                try:
                    best[name] = min(best[name], fn(directory, lines, args.checkpoint_records))
                finally:
                    shutil.rmtree(directory)
        old, new = (best[k] / count * 1e6 for k in ("buffered", "per-record"))
        print(f"{label:<22}{len(lines[0]):>8}{old:>13.1f}{new:>15.1f}{new - old:>10.1f}{dumps_us:>11.1f}")


if __name__ == "__main__":
    main()
