"""Server utilisation of ``--turns all``: conversations of 1–6 turns against a capacity-limited fake SGLang server.

The fake (its own process, pinned to one core) serves at most ``--capacity`` (B) requests at once, each holding
its slot for ``--time-per-token-s`` × its output ids, the rest waiting in its FIFO queue; it also serves the parser
endpoints each turn calls. ``eagle-datagen run --turns all`` runs in another process pinned to the other core.
A turn can only be sent once the turn before it came back, was parsed and its successor rendered, so what is
measured is whether the client keeps the server full while it walks every conversation turn by turn.

``while work remains``: busy slots / B from the first request to the moment fewer than B conversations are left
unfinished (from then on no client could keep every slot busy: each conversation has one turn in flight at
most). ``whole run``: to the last response.

Example (the figure in docs/performance.md)::

    .venv/bin/python scripts/bench_turns.py --conversations 1000 --capacity 32 --time-per-token-s 0.0004 \\
        --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_client import PY, FakeServer, busy_integral, cpu_cores, machine, tiny_tokenizer  # noqa: E402


def conversations(n: int, seed: int) -> tuple[list[dict[str, Any]], int]:
    """``n`` conversations of 1–6 user turns (the source's assistant turns are regenerated); their turn count."""
    rng = random.Random(seed)
    rows, turns = [], 0
    for i in range(n):
        users = rng.randint(1, 6)
        turns += users
        messages: list[dict[str, Any]] = []
        for u in range(users):
            messages.append(
                {"role": "user", "content": f"conversation {i} question {u}: " + "word " * rng.randint(5, 40)}
            )
            if u < users - 1:
                messages.append({"role": "assistant", "content": "a source reply that is regenerated"})
        rows.append({"id": f"conv-{i}", "messages": messages})
    return rows, turns


def read_records(out: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted((out / "shards").glob("shard_*.jsonl*")):
        records += [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return records


def one_run(args: argparse.Namespace, work: Path, tokenizer: Path, prompts: Path, fake: FakeServer, core: int | None,
            index: int) -> dict[str, Any]:  # fmt: skip
    fake.reset()
    out = work / f"out-{index}"
    command = [
        PY, "-m", "eagle_datagen.cli", "run", "--prompts", str(prompts), "--out", str(out), "--tokenizer",
        str(tokenizer), "--server-url", fake.url, "--no-progress", "--turns", "all", "--reasoning-parser-name",
        "kimi_k2", "--max-new-tokens", str(args.output_len_max + 8), "--shard-size", "100000",
    ]  # fmt: skip
    if args.concurrency:
        command += ["--concurrency", str(args.concurrency)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRANSFORMERS_VERBOSITY": "error"}
    offset = time.time() - time.monotonic()  # records stamp wall time; the fake's timeline is monotonic
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if core is not None:
        os.sched_setaffinity(proc.pid, {core})
    output, _ = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"eagle-datagen run failed ({proc.returncode}):\n{output.decode()[-3000:]}")
    wall = time.monotonic() - started
    stats = fake.stats()
    if stats.get("timeline_truncated"):
        raise RuntimeError("the fake's timeline was truncated; use fewer conversations")
    timeline = [(float(t), int(b)) for t, b in stats["timeline"]]
    records = read_records(out)
    last: dict[str, float] = {}
    for record in records:
        last[record["conversation"]] = max(last.get(record["conversation"], 0.0), record["finished"] - offset)
    ends = sorted(last.values())
    start, end_all = float(stats["first_request_t"]), float(stats["last_response_t"])
    b = args.capacity
    end_work = ends[len(ends) - b] if len(ends) >= b else end_all  # fewer than B conversations left after this
    return {
        "records": len(records),
        "distinct_ids": len({r["id"] for r in records}),
        "conversations": len(last),
        "wall_s": round(wall, 2),
        "while_work_remains": busy_integral(timeline, start, end_work) / (b * (end_work - start)),
        "whole_run": busy_integral(timeline, start, end_all) / (b * (end_all - start)),
        "work_window_s": round(end_work - start, 2),
        "run_s": round(end_all - start, 2),
        "max_waiting": stats.get("max_waiting"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--time-per-token-s", type=float, default=0.0004)
    parser.add_argument("--output-len-min", type=int, default=16)
    parser.add_argument("--output-len-max", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=0, help="the client's; 0: from max_running_requests")
    parser.add_argument("--max-running-requests", type=int, default=0, help="what the fake reports [2 x capacity]")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-turns-") as tmp:
        work = Path(tmp)
        tokenizer = tiny_tokenizer(work)
        from transformers import AutoTokenizer

        from eagle_datagen.testing.fake_sglang import family_config

        hf = AutoTokenizer.from_pretrained(str(tokenizer))
        rows, turns = conversations(args.conversations, args.seed)
        prompts = work / "conversations.jsonl"
        prompts.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        client_core, server_core = cpu_cores()
        config = {
            "vocab_size": len(hf),
            "eos_id": hf.eos_token_id,
            "family": family_config(hf),
            "capacity": args.capacity,
            "time_per_token_s": args.time_per_token_s,
            "output_len_min": args.output_len_min,
            "output_len_max": args.output_len_max,
            "max_running_requests": args.max_running_requests or 2 * args.capacity,
        }
        runs = []
        with FakeServer(config, work, server_core) as fake:
            for i in range(args.repeat):
                result = one_run(args, work, tokenizer, prompts, fake, client_core, i)
                if result["records"] != turns or result["distinct_ids"] != turns:
                    raise RuntimeError(f"{result['records']} records, {turns} turns planned")
                runs.append(result)
                print(json.dumps(result), flush=True)
        work_share = statistics.median(r["while_work_remains"] for r in runs)
        whole = statistics.median(r["whole_run"] for r in runs)
        print(
            f"\n{machine()}\n{args.conversations} conversations, {turns} turns, capacity {args.capacity}, "
            f"{args.time_per_token_s * 1000:.2f} ms/token: utilisation {100 * work_share:.2f}% while work remains, "
            f"{100 * whole:.2f}% over the whole run (median of {len(runs)})"
        )


if __name__ == "__main__":
    main()
