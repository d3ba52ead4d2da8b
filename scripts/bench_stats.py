"""How fast `eagle-datagen stats` streams shards, on one core.

Writes a synthetic run (manifest + shards of Kimi-range ids in the writer's compact layout, with stamps,
variants, think-close and tool-call ids) of about --mb MB, then times `report.stats.collect` over it
--repeat times, pinned to one core. Prints MB/s and records/s; the figure goes into docs/performance.md.

    .venv/bin/python scripts/bench_stats.py --mb 400 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from eagle_datagen.report.stats import collect

THINK_OPEN, THINK_CLOSE, TOOL, EOS = 163606, 163607, 163595, 163586
VOCAB = 163_840


def write_run(directory: Path, mb: float, *, prompt_len: int, output_len: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    shards = directory / "shards"
    shards.mkdir(parents=True)
    manifest = {
        "format": 1,
        "plan": {"tokenizer": {"path": str(directory / "no-tokenizer")}},
        "facts": {
            "think_open_id": THINK_OPEN,
            "think_close_id": THINK_CLOSE,
            "eos_token_ids": [EOS],
            "vocab_size": VOCAB,
        },
        "runs": [{"command": "run", "started": "x", "finished": "y"}],
    }
    (directory / "manifest.json").write_bytes(orjson.dumps(manifest))
    # a pool of id lists reused across records keeps generation fast; the bytes per record stay realistic
    pool = [[min(int(rng.expovariate(1 / 6000)), VOCAB - 1) for _ in range(output_len * 2)] for _ in range(64)]
    written = records = shard = 0
    handle = (shards / "shard_00000.jsonl").open("wb")
    now = 1.76e9
    while written < mb * 1e6:
        body = rng.choice(pool)
        n = rng.randrange(output_len // 4, output_len * 2)
        output = body[:n]
        output[rng.randrange(0, n)] = THINK_CLOSE
        output.append(EOS)
        prompt = [*rng.choice(pool)[: rng.randrange(prompt_len // 2, prompt_len * 3 // 2)], THINK_OPEN]
        started = now + records * 0.001
        line = orjson.dumps(
            {
                "id": f"r{records}", "key": f"r{records}", "sample": 0, "prompt_ids": prompt, "output_ids": output,
                "finish_reason": {"type": "stop", "matched": EOS}, "completion_tokens": len(output),
                "started": round(started, 3), "finished": round(started + 9.5, 3),
                "server": f"http://node{records % 4}:30000", "variant": "thinking" if records % 10 < 7 else "chat",
            }
        ) + b"\n"  # fmt: skip
        handle.write(line)
        written += len(line)
        records += 1
        if records % 10_000 == 0:
            handle.close()
            shard += 1
            handle = (shards / f"shard_{shard:05d}.jsonl").open("wb")
    handle.close()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=400.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=2000)
    parser.add_argument("--core", type=int, default=0, help="CPU to pin to")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    with tempfile.TemporaryDirectory(prefix="bench-stats-") as tmp:
        run = Path(tmp) / "run"
        records = write_run(run, args.mb, prompt_len=args.prompt_len, output_len=args.output_len)
        rates, cpu = [], []
        for _ in range(args.repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            report = collect(run)
            wall, used = time.perf_counter() - t0, time.process_time() - c0
            rates.append(report.bytes / wall / 1e6)
            cpu.append(report.bytes / used / 1e6)
        print(
            f"{records:,} records, {report.bytes / 1e6:,.0f} MB (prompt ~{args.prompt_len}, output ~{args.output_len} ids): "
            f"wall {min(rates):,.0f}-{max(rates):,.0f} MB/s (median {statistics.median(rates):,.0f}), "
            f"per CPU-second {statistics.median(cpu):,.0f} MB/s, {records / (report.bytes / statistics.median(rates) / 1e6):,.0f} records/s"
        )


if __name__ == "__main__":
    main()
