"""Rendering throughput: prompts/s per core, row by row, batched, and over a process pool.

Two tokenizers, both with the tiny Kimi-style chat template:

``fast``  the tiny byte-level BPE ``tokenizer.json`` (a Rust ``tokenizers`` tokenizer, like most models).
``slow``  a tokenizer shipped as Python code and loaded with ``trust_remote_code`` (like Kimi's
          tiktoken-based one): a regex pre-tokenizer and a per-byte vocabulary in pure Python.

Modes, each on the same rows, ids checked equal to row-by-row rendering:

``per-row``   ``Renderer.render`` once per row (what the Producer does without ``render_chunks``).
``batched``   ``Renderer.render_many`` on chunks of 64 rows (one ``apply_chat_template`` per chunk).
``pool=W``    ``RenderPool`` with W worker processes (started before the clock; start-up timed apart).

The process is pinned to one core (its Rust threads too); pool workers get every core. In-process: prompts/s/core = rows / CPU seconds of this process (all
threads). Pool modes report wall rows/s on W cores and CPU seconds per row summed over the workers.

    .venv/bin/python scripts/bench_render.py --rows 20000 --slow-rows 3000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import machine, pin, prompt_row, tiny_tokenizer

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SLOW_TOKENIZER_CODE = '''"""A deliberately slow tokenizer shipped as code (loaded with trust_remote_code), for benchmarks."""

import re

from transformers import PreTrainedTokenizer

PATTERN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\\W\\d_]+| ?\\d{1,3}| ?[^\\s\\w]+|\\s+(?!\\S)|\\s+""")


class SlowByteTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self._vocab = {f"<0x{b:02X}>": b for b in range(256)}
        self._tokens = {v: k for k, v in self._vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 256

    def get_vocab(self):
        return {**self._vocab, **self.added_tokens_encoder}

    def _tokenize(self, text, **kwargs):
        tokens = []
        for piece in PATTERN.findall(text):
            tokens.extend(f"<0x{b:02X}>" for b in piece.encode("utf-8"))
        return tokens

    def _convert_token_to_id(self, token):
        return self._vocab.get(token, 0)

    def _convert_id_to_token(self, index):
        return self._tokens.get(index, "<0x00>")

    def convert_tokens_to_string(self, tokens):
        return bytes(self._vocab.get(t, 0) for t in tokens).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def slow_tokenizer(fast: Path, out: Path) -> Path:
    """A trust_remote_code tokenizer directory with the same chat template and special tokens as ``fast``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenization_slowbyte.py").write_text(SLOW_TOKENIZER_CODE)
    config = orjson.loads((fast / "tokenizer_config.json").read_bytes())
    slow_config = {
        "tokenizer_class": "SlowByteTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_slowbyte.SlowByteTokenizer", None]},
        "eos_token": config["eos_token"],
        "additional_special_tokens": config.get("additional_special_tokens", []),
        "chat_template": config["chat_template"],
        "model_max_length": 1_000_000,
    }
    (out / "tokenizer_config.json").write_bytes(orjson.dumps(slow_config))
    return out


def rows_of(n: int, chars: int = 0) -> list[Any]:
    """``n`` parsed rows of the four shapes; with ``chars``, each user turn is padded to about that length."""
    from eagle_datagen.inputs.prompts import parse_row

    filler = " ".join(f"word{k} and, {k * 7}" for k in range(chars // 14 + 1))[:chars]
    rows = []
    for i in range(n):
        raw = prompt_row(i)
        if chars:
            raw = {"id": raw.get("id", f"c{i}"), "messages": [{"role": "user", "content": f"{i}: {filler}"}]}
            if i % 4 == 3:
                raw["tools"] = prompt_row(3)["tools"]
        rows.append(parse_row(orjson.dumps(raw), "prompts.jsonl", i + 1))
    return rows


def cpu_of(pids: list[int]) -> float:
    """CPU seconds (utime + stime) the processes ``pids`` have used so far, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def measure_in_process(renderer: Any, rows: list[Any], mode: str) -> tuple[float, float, list[list[int]]]:
    wall, cpu = time.perf_counter(), time.process_time()
    if mode == "per-row":
        ids = [renderer.render(row) for row in rows]
    else:
        ids = []
        for start in range(0, len(rows), 64):
            ids.extend(renderer.render_many(rows[start : start + 64]))
    return time.perf_counter() - wall, time.process_time() - cpu, ids


def measure_pool(renderer: Any, path: Path, rows: list[Any], workers: int, trust: bool) -> dict[str, Any]:
    from eagle_datagen.inputs.render import RenderPool

    started = time.perf_counter()
    pool = RenderPool(renderer, path, workers=workers, trust_remote_code=trust)
    try:
        while not all(p.done() for p in pool._pings):
            time.sleep(0.01)
        for pid in pool._executor._processes:  # spawned on our one core: let them use them all
            os.sched_setaffinity(pid, ALL_CORES)
        start_up = time.perf_counter() - started
        chunks = [rows[i : i + 64] for i in range(0, len(rows), 64)]
        pids = list(pool._executor._processes)
        workers_cpu, wall, cpu = cpu_of(pids), time.perf_counter(), time.process_time()
        ids = [ids for result in pool.render_chunks(chunks) for ids in result]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        workers_cpu = cpu_of(pids) - workers_cpu
    finally:
        pool.close()
    return {"wall": wall, "cpu": cpu + workers_cpu, "start_up_s": start_up, "ids": ids}


def bench_tokenizer(name: str, path: Path, rows: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from eagle_datagen.inputs.render import Renderer, load_tokenizer

    trust = name == "slow"
    renderer = Renderer(load_tokenizer(path, trust_remote_code=trust))
    for row in rows[:50]:
        renderer.render(row)
    results: dict[str, list[dict[str, float]]] = {}
    reference: list[list[int]] | None = None
    for repeat in range(args.repeat):
        modes = ["per-row", "batched"] if repeat % 2 == 0 else ["batched", "per-row"]
        for mode in modes:
            wall, cpu, ids = measure_in_process(renderer, rows, mode)
            reference = reference or ids
            assert ids == reference, f"{name} {mode}: ids differ from row-by-row rendering"
            results.setdefault(mode, []).append({"rows_per_cpu_s": len(rows) / cpu, "rows_per_s": len(rows) / wall})
        for workers in args.workers:
            measured = measure_pool(renderer, path, rows, workers, trust)
            assert measured.pop("ids") == reference, f"{name} pool={workers}: ids differ"
            results.setdefault(f"pool={workers}", []).append(
                {
                    "rows_per_cpu_s": len(rows) / measured["cpu"],
                    "rows_per_s": len(rows) / measured["wall"],
                    "start_up_s": measured["start_up_s"],
                }
            )
    summary = {}
    for mode, runs in results.items():
        summary[mode] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        summary[mode]["spread"] = (max(r["rows_per_s"] for r in runs) - min(r["rows_per_s"] for r in runs)) / summary[
            mode
        ]["rows_per_s"]
    return {"rows": len(rows), "modes": summary, "runs": results}


ALL_CORES = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000, help="rows for the fast tokenizer")
    parser.add_argument("--slow-rows", type=int, default=2_000, help="rows for the slow tokenizer")
    parser.add_argument("--long-chars", type=int, default=2_000, help="user turn length of the long rows")
    parser.add_argument("--workers", type=int, nargs="*", default=[len(ALL_CORES) or 1])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pin(min(ALL_CORES))  # before any thread starts, so tokenizers' Rust threads share the one core
    work = Path(tempfile.mkdtemp(prefix="bench-render-"))
    try:
        fast = tiny_tokenizer(work)
        slow = slow_tokenizer(fast, work / "slow-tokenizer")
        report: dict[str, Any] = {"machine": machine(), "argv": sys.argv, "tokenizers": {}}
        cases = (
            ("fast", "short", fast, args.rows, 0),
            ("fast", "long", fast, args.slow_rows, args.long_chars),
            ("slow", "long", slow, args.slow_rows, args.long_chars),
        )
        for name, length, path, n, chars in cases:
            result = bench_tokenizer(name, path, rows_of(n, chars), args)
            report["tokenizers"][f"{name}/{length}"] = result
            base = result["modes"]["per-row"]
            size = f"{chars}-char user turns" if chars else "short rows (tests/conftest.py shapes)"
            print(f"{name} tokenizer, {n} {size} (medians of {args.repeat}; ratio to per-row):")
            for mode, m in result["modes"].items():
                text = (
                    f"  {mode:9s} {m['rows_per_cpu_s']:7.0f} prompts/CPU-s (×{m['rows_per_cpu_s'] / base['rows_per_cpu_s']:.2f})"
                    f"  {m['rows_per_s']:7.0f} prompts/s wall (×{m['rows_per_s'] / base['rows_per_s']:.2f}, "
                    f"spread {100 * m['spread']:.0f}%)"
                )
                if "start_up_s" in m:
                    text += f", workers up in {m['start_up_s']:.1f} s"
                print(text, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report["machine"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
