"""Resume start-up with 100k finished records: ShardStore.open, and `eagle-datagen resume` to its first request.

Builds an output directory the way a real run leaves it: ``eagle-datagen run`` against the fake writes
the manifest (stopped at once with SIGINT), then the shards are written directly in ShardStore's
layout: ``--records`` records of ``--output-len`` output ids in finalized ``shard_NNNNN.jsonl`` files
with ``.ids`` sidecars and manifest entries, plus one ``.partial`` of ``--partial`` records. The
prompts file has ``--pending`` rows more than that, so resume has work left.

Timed, each in a fresh process:

``open``          ``ShardStore(...).open(manifest.shard_map())`` (sidecars and manifest entries present).
``resume``        spawning ``eagle-datagen resume --out DIR --no-progress --no-preflight`` → the fake
                  receiving its first /generate (both on CLOCK_MONOTONIC); then SIGINT.
``open-rebuild``  ``open`` with the sidecars deleted and no manifest entries (every shard re-read and
                  re-hashed: the worst case after losing them).

The shards were just written, so they are in the page cache: these are warm-cache figures.

    .venv/bin/python scripts/bench_resume.py --records 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import PY, ROOT, FakeServer, machine, tiny_tokenizer, tokenizer_ids, write_prompts

SHARD_SIZE = 10_000
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}


def start_run(prompts: Path, out: Path, tokenizer: Path, fake: FakeServer, output_len: int) -> None:
    """A real `eagle-datagen run` that writes its manifest, stopped before any record is written."""
    proc = subprocess.Popen(
        [PY, "-m", "eagle_datagen", "run", "--prompts", str(prompts), "--out", str(out), "--tokenizer",
         str(tokenizer), "--server-url", fake.url, "--no-progress", "--no-preflight", "--concurrency", "1",
         "--max-new-tokens", str(output_len), "--shard-size", str(SHARD_SIZE), "--grace-period-s", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
    )  # fmt: skip
    wait_first_request(fake, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode not in (0, 130):
        raise RuntimeError(f"eagle-datagen run failed ({proc.returncode}): {err.decode()[-2000:]}")


def wait_first_request(fake: FakeServer, proc: subprocess.Popen[bytes]) -> float:
    started = time.monotonic()
    while True:
        first = fake.stats()["first_request_t"]
        if first is not None:
            return float(first)
        if proc.poll() is not None or time.monotonic() - started > 120:
            raise RuntimeError("the command ended or stalled before its first request")
        time.sleep(0.005)


def write_shards(out: Path, keys: list[str], output_len: int, vocab: int, eos: int, partial: int) -> int:
    """Finalized shards + sidecars + manifest entries for all but the last ``partial`` keys; bytes written."""
    from eagle_datagen.store.manifest import Manifest
    from eagle_datagen.store.shards import ShardInfo, shard_name

    shards = out / "shards"
    shutil.rmtree(shards)
    shards.mkdir()
    rng = random.Random(0)
    outputs = [orjson.dumps([rng.randrange(3, vocab) for _ in range(output_len - 1)] + [eos]) for _ in range(16)]
    finish = orjson.dumps({"type": "stop", "matched": eos})
    prompt = orjson.dumps([rng.randrange(3, vocab) for _ in range(40)])

    def line(i: int, key: str) -> bytes:
        rid = orjson.dumps(key)
        return (
            b'{"id":' + rid + b',"key":' + rid + b',"sample":0,"prompt_ids":' + prompt + b',"output_ids":'
            + outputs[i % 16] + b',"finish_reason":' + finish + b',"completion_tokens":%d}\n' % output_len
        )  # fmt: skip

    manifest = Manifest.load(out)
    manifest.shards = []
    finished = len(keys) - partial
    total = 0
    for index, start in enumerate(range(0, finished, SHARD_SIZE)):
        chunk = keys[start : min(finished, start + SHARD_SIZE)]
        data = b"".join(line(start + j, key) for j, key in enumerate(chunk))
        path = shards / shard_name(index)
        path.write_bytes(data)
        path.with_suffix(".ids").write_text("".join(f"{key}\n" for key in chunk))
        manifest.shards.append(ShardInfo(path.name, len(chunk), hashlib.sha256(data).hexdigest()))
        total += len(data)
    data = b"".join(line(finished + j, key) for j, key in enumerate(keys[finished:]))
    (shards / (shard_name(len(manifest.shards)) + ".partial")).write_bytes(data)
    manifest.save()
    return total + len(data)


OPEN_CODE = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from eagle_datagen.store.manifest import Manifest
from eagle_datagen.store.shards import ShardStore
out = Path(sys.argv[1])
known = Manifest.load(out).shard_map() if sys.argv[2] == "known" else {}
t1 = time.perf_counter()
store = ShardStore(out / "shards", 10_000, lambda info: None)
report = store.open(known)
t2 = time.perf_counter()
store.close()
print(json.dumps({"open_s": t2 - t1, "import_and_manifest_s": t1 - t0, "done": len(store.done),
                  "rebuilt": len(report.rebuilt)}))
"""


def time_open(out: Path, known: bool) -> dict[str, Any]:
    proc = subprocess.run(
        [PY, "-c", OPEN_CODE, str(out), "known" if known else "none"], capture_output=True, env=ENV, check=True
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def time_resume(out: Path, fake: FakeServer) -> float:
    fake.reset()
    started = time.monotonic()
    proc = subprocess.Popen(
        [PY, "-m", "eagle_datagen", "resume", "--out", str(out), "--no-progress", "--no-preflight",
         "--grace-period-s", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
    )  # fmt: skip
    try:
        return wait_first_request(fake, proc) - started
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _list(values: list[float], digits: int) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000, help="records in finalized shards")
    parser.add_argument("--partial", type=int, default=5_000, help="records in the .partial shard")
    parser.add_argument("--pending", type=int, default=5_000, help="prompts left to do")
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-resume-", dir=args.work))
    report: dict[str, Any] = {"machine": machine(), "argv": sys.argv}
    try:
        tokenizer = tiny_tokenizer(work)
        vocab, eos = tokenizer_ids(tokenizer)
        rows = args.records + args.partial + args.pending
        prompts = write_prompts(work / "prompts.jsonl", rows, distinct=2000)  # every row has id r{i}
        keys = [f"r{i}" for i in range(args.records + args.partial)]
        out = work / "out"
        config = {
            "vocab_size": vocab,
            "eos_id": eos,
            "fixed_output_len": args.output_len,
            "latency_s": 2.0,
        }  # Ctrl-C waits for a slot (see docs)
        with FakeServer(config, work, None) as fake:
            start_run(prompts, out, tokenizer, fake, args.output_len)
            size = write_shards(out, keys, args.output_len, vocab, eos, args.partial)
            print(f"{len(keys)} records ({size / 2**20:.0f} MB of shards), {rows} prompts", flush=True)
            opens = [time_open(out, known=True) for _ in range(args.repeat)]
            assert all(o["done"] == len(keys) for o in opens), opens
            resumes = [time_resume(out, fake) for _ in range(args.repeat)]
        for path in (out / "shards").glob("*.ids"):
            path.unlink()
        rebuild = time_open(out, known=False)
        report.update(
            records=len(keys),
            shard_mb=size / 2**20,
            open_s=[o["open_s"] for o in opens],
            resume_first_request_s=resumes,
            open_rebuild_s=rebuild["open_s"],
        )
        open_s = [o["open_s"] for o in opens]
        print(f"ShardStore.open: {_list(open_s, 3)} s (median {statistics.median(open_s):.3f} s)")
        print(
            f"eagle-datagen resume → first request: {_list(resumes, 2)} s (median {statistics.median(resumes):.2f} s)"
        )
        print(f"ShardStore.open without sidecars or manifest entries: {rebuild['open_s']:.2f} s")
        print(report["machine"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
