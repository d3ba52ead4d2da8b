"""Peak RSS against dataset size, and how soon the first request leaves for a 1M-row prompts file.

Memory: ``eagle-datagen run`` (in-process in a child pinned to one core, the fake on the other) over
N generated small prompts with 4-id outputs; peak RSS is the child's ``ru_maxrss``. To keep a 1M-row
run short, prompts are "rendered" into ids made from the row key (``ours-synthetic``: no tokenizer
work; rendering holds no per-row state, so it cannot change how memory grows). ``--real-render``
adds a run with the real tokenizer at the smallest size. What grows with N is measured apart: the
set of done ids (``ShardStore.done``) and the reader's key dict (``PromptReader._seen``), rebuilt in
a fresh process at the largest N.

First request: ``python -m eagle_datagen run ... --no-preflight`` as a subprocess on the largest
file; the time from spawning it to the fake receiving the first /generate (both read
CLOCK_MONOTONIC), then SIGINT.

    .venv/bin/python scripts/bench_memory.py --sizes 100000 1000000 --real-render
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import (
    PY,
    ROOT,
    FakeServer,
    cpu_cores,
    machine,
    run_child,
    tiny_tokenizer,
    tokenizer_ids,
    write_prompts,
)


def structures_mb(n: int) -> dict[str, float]:
    """RSS that N done ids and N reader keys take, measured in a fresh process."""
    code = f"""
import resource, hashlib, json
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
keys = []
for i in range({n}):
    kind = i % 4
    keys.append(f"p{{i}}" if kind == 0 else str(i) if kind == 1 else f"t{{i}}" if kind == 3
                else "h:" + hashlib.blake2b(str(i).encode(), digest_size=10).hexdigest())
base = rss()
done = set(keys)
after_set = rss()
seen = {{k: (i, k.startswith("h:")) for i, k in enumerate(keys)}}
after_dict = rss()
print(json.dumps({{"done_set_mb": after_set - base, "reader_seen_mb": after_dict - after_set}}))
"""
    out = subprocess.run([PY, "-c", code], capture_output=True, check=True, text=True).stdout
    result: dict[str, float] = json.loads(out)
    return result


def first_request_s(prompts: Path, tokenizer: Path, fake: FakeServer, work: Path) -> float:
    """Spawn → first /generate at the fake, for ``eagle-datagen run`` as a user starts it."""
    out = work / f"first-{time.monotonic_ns()}"
    fake.reset()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.monotonic()
    proc = subprocess.Popen(
        [PY, "-m", "eagle_datagen", "run", "--prompts", str(prompts), "--out", str(out), "--tokenizer",
         str(tokenizer), "--server-url", fake.url, "--no-progress", "--no-preflight", "--max-new-tokens", "16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        while True:
            first = fake.stats()["first_request_t"]
            if first is not None:
                return float(first) - started
            if proc.poll() is not None or time.monotonic() - started > 300:
                raise RuntimeError("the run ended or stalled before its first request")
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--real-render", action="store_true", help="also run the smallest size with the tokenizer")
    parser.add_argument("--first-request-repeat", type=int, default=3)
    parser.add_argument("--work", default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    client_core, server_core = cpu_cores()
    work = Path(tempfile.mkdtemp(prefix="bench-memory-", dir=args.work))
    report: dict[str, Any] = {"machine": machine(), "argv": sys.argv, "runs": []}
    try:
        tokenizer = tiny_tokenizer(work)
        vocab, eos = tokenizer_ids(tokenizer)
        config = {"vocab_size": vocab, "eos_id": eos, "fixed_output_len": 4}
        plan = [(n, "ours-synthetic") for n in args.sizes]
        if args.real_render:
            plan.insert(0, (min(args.sizes), "ours"))
        with FakeServer(config, work, server_core) as fake:
            files: dict[int, Path] = {}
            for n, client in plan:
                prompts = files.get(n) or write_prompts(work / f"prompts-{n}.jsonl", n)
                files[n] = prompts
                fake.reset()
                out = work / f"out-{n}-{client}"
                spec = {
                    "client": client, "prompts": str(prompts), "tokenizer": str(tokenizer), "url": fake.url,
                    "out": str(out), "max_new_tokens": 16, "concurrency": None, "core": client_core,
                    "count_tokens": False,
                }  # fmt: skip
                result = run_child(spec, timeout_s=900)
                result.update(prompts=n, prompts_mb=prompts.stat().st_size / 2**20)
                report["runs"].append(result)
                print(
                    f"{client:15s} {n:8d} prompts: peak RSS {result['max_rss_mb']:6.0f} MB, "
                    f"{result['responses_per_s']:6.0f} responses/s, {result['wall_s']:.0f} s",
                    flush=True,
                )
                shutil.rmtree(out, ignore_errors=True)
            largest = files[max(args.sizes)]
            latencies = [first_request_s(largest, tokenizer, fake, work) for _ in range(args.first_request_repeat)]
            report["first_request_s"] = latencies
            print(
                f"first request after spawning `eagle-datagen run` on {max(args.sizes)} rows "
                f"({largest.stat().st_size / 2**20:.0f} MB): {', '.join(f'{x:.2f}' for x in latencies)} s"
            )
        report["structures"] = structures_mb(max(args.sizes))
        print(f"at {max(args.sizes)} prompts: {report['structures']}")
        print(f"bench process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
        print(report["machine"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
