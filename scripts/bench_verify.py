"""Throughput of ``verify`` on a realistic run directory, in-process, on one core.

Writes a run directory with Kimi-K2.5-sized ids (vocabulary 163,840; <think> 163606, </think> 163607,
<|im_end|> 163586) through the real ShardStore and Manifest, then times ``eagle_datagen.verify.verify.verify``
over it (no prompt re-render: that is bounded by the chat template, not by the shard reader)::

    .venv/bin/python scripts/bench_verify.py                      # 20,000 records x 1,000 output ids
    .venv/bin/python scripts/bench_verify.py --profile            # and the top functions by own time

Ids follow a rough frequency profile of BPE text (60% below 30,000, 30% below 100,000, the rest up to the
special tokens), so a record line is about 6 bytes per id, as in real shards.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.store.shards import ShardStore
from eagle_datagen.verify.verify import format_report, verify

VOCAB = 163_840
THINK_OPEN, THINK_CLOSE, IM_END, EOS = 163606, 163607, 163586, 163585
PROMPT_TAIL = [163588, 1, 163601, THINK_OPEN]  # <|im_assistant|>assistant<|im_middle|><think>
POOL = 1 << 20


def id_pool(rng: random.Random) -> list[int]:
    bands = rng.choices([(100, 30_000), (30_000, 100_000), (100_000, 163_584)], weights=[6, 3, 1], k=POOL)
    return [rng.randrange(lo, hi) for lo, hi in bands]


def make_run(out: Path, records: int, output_len: int, prompt_len: int, shard_size: int, seed: int) -> int:
    rng = random.Random(seed)
    pool = id_pool(rng)
    manifest = Manifest(
        out / MANIFEST_NAME,
        plan={
            "prompts": {"path": str(out / "absent-prompts.jsonl"), "sha256": ""},
            "tokenizer": {"path": str(out / "absent-tokenizer"), "fingerprint": ""},
            "chat_template_kwargs": {},
            "sampling_params": {"max_new_tokens": output_len, "temperature": 1.0},
            "samples_per_prompt": 1,
            "shard_size": shard_size,
        },
        facts={
            "vocab_size": VOCAB,
            "model_vocab_size": VOCAB,
            "eos_token_ids": [EOS, IM_END],
            "stop_token_ids": [EOS, IM_END],
            "think_open_id": THINK_OPEN,
            "think_close_id": THINK_CLOSE,
        },
    )
    manifest.save()
    store = ShardStore(out / "shards", shard_size, manifest.add_shard)
    store.open({})
    for i in range(records):
        start = rng.randrange(POOL - output_len - prompt_len)
        prompt = [163594, *pool[start : start + prompt_len - len(PROMPT_TAIL) - 1], *PROMPT_TAIL]
        body = pool[start + prompt_len : start + prompt_len + output_len - 2]
        cut = len(body) * 2 // 3
        output = [*body[:cut], THINK_CLOSE, *body[cut:], IM_END]
        record = {"id": f"row-{i:07d}", "key": f"row-{i:07d}", "sample": 0, "prompt_ids": prompt, "output_ids": output,
                  "finish_reason": {"type": "stop", "matched": IM_END}, "completion_tokens": len(output)}  # fmt: skip
        store.append(record["id"], orjson.dumps(record) + b"\n")
    store.close()
    return sum(p.stat().st_size for p in (out / "shards").glob("shard_*.jsonl*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--shard-size", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best is reported")
    parser.add_argument("--dir", type=Path, help="where to write the run directory [a temporary one]")
    parser.add_argument("--profile", action="store_true", help="profile one more run and print the top functions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_only:
        make_run(args.dir, args.records, args.output_len, args.prompt_len, args.shard_size, args.seed)
        return

    out = args.dir or Path(tempfile.mkdtemp(prefix="bench-verify-"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        # generated in a child process, so the timed process starts with a clean heap
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--dir", str(out), "--make-only"], check=True)
        size = sum(p.stat().st_size for p in (out / "shards").glob("shard_*.jsonl*"))
        print(f"run directory: {out}; {args.records:,} records, {size / 1e6:,.1f} MB of shards; {os.cpu_count()} CPUs")
        time_verify(out, size, args.records, args.repeat)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(verify, [out], rerender=False)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    finally:
        if args.dir is None:
            shutil.rmtree(out, ignore_errors=True)


def time_verify(out: Path, size: int, records: int, repeat: int) -> None:
    walls: list[float] = []
    cpus: list[float] = []
    report: Any = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        report = verify([out], rerender=False)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert report.ok, format_report(report)
    print(format_report(report))
    load = os.getloadavg()[0]
    print(
        f"verify, best of {repeat}: wall {min(walls):.2f} s = {size / min(walls) / 1e6:,.0f} MB/s; "
        f"CPU {min(cpus):.2f} s = {size / min(cpus) / 1e6:,.0f} MB/s, {records / min(cpus):,.0f} records/s "
        f"on one core (median {size / sorted(cpus)[len(cpus) // 2] / 1e6:,.0f} MB/s; load average {load:.1f})"
    )


if __name__ == "__main__":
    main()
