"""Stand-in for ``python -m sglang.launch_server``: serves eagle_datagen's fake SGLang in the foreground.

Accepts SGLang's launch flags (unknown ones are ignored), prints SGLang-like log lines (its resolved server args,
``api_key`` and ``admin_api_key`` among them, as SGLang 0.5.23 does, and a ``\r`` progress bar), spawns one idle
child process (SGLang runs a process tree), and serves the fake on ``--host``/``--port`` (loopback only).

Env knobs:
    FAKE_SGLANG_STARTUP_DELAY_S   /health and /ready answer 503 for this long after binding.
    FAKE_SGLANG_FAIL_AT_STARTUP=1 print some log lines, then exit 1 before listening.
    FAKE_SGLANG_CRASH_AFTER=N     after N /generate responses, os._exit(1), dropping requests in flight;
                                  with FAKE_SGLANG_STATE_DIR set, only on the first run (a marker file there).
    FAKE_SGLANG_STATE_DIR         directory for that marker.
    FAKE_SGLANG_CONFIG_JSON       FakeConfig fields as a JSON object (launch flags win where both are given).
    FAKE_SGLANG_CHATTER_S=S       until it exits, print ``chatter N: api_key='…' admin_api_key='…' \xff`` lines, each
                                  in two writes S seconds apart, cut in the middle of the API key.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle_datagen.testing.fake_sglang import FakeConfig, serve

CRASH_MARKER = "fake-sglang-crashed-once"
DEPRECATION = "'python -m sglang.launch_server' is still supported, but 'sglang serve' is the recommended entrypoint."
_children: list[subprocess.Popen[bytes]] = []
#: Held for each whole line, so that the chatter thread's split lines do not interleave with others.
_write_lock = threading.Lock()


def log(msg: str) -> None:
    """One SGLang-style log line on stdout."""
    with _write_lock:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", flush=True)


def write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def progress_bar(what: str, total: int) -> None:
    """A tqdm-style bar: one ``\r``-separated update per step, a newline at the end (SGLang's shard loading)."""
    with _write_lock:
        for done in range(total + 1):
            write(f"\r{what}: {100 * done // total:3d}% Completed | {done}/{total} [00:00<00:00]".encode())
        write(b"\n")


def chatter(api_key: str | None, admin_api_key: str | None, pause_s: float) -> None:
    """Lines holding both keys, each cut in the middle of the API key into two writes ``pause_s`` apart."""
    for n in range(1_000_000):
        line = f"chatter {n}: api_key={api_key!r} admin_api_key={admin_api_key!r} ".encode() + b"\xff\n"
        cut = line.index(b"api_key=") + len("api_key='") + len(api_key or "") // 2
        with _write_lock:
            write(line[:cut])
            time.sleep(pause_s)
            write(line[cut:])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    ap.add_argument("--model-path", "--model", dest="model_path", required=True)
    ap.add_argument("--tokenizer-path")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    ap.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--api-key")
    ap.add_argument("--admin-api-key")
    ap.add_argument("--reasoning-parser")
    ap.add_argument("--device")
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--max-running-requests", type=int)
    args, _unknown = ap.parse_known_args(argv)
    return args


def _crash_armed(state_dir: str | None) -> bool:
    """True on the first run; later runs (marker present) do not crash again."""
    if not state_dir:
        return True
    marker = Path(state_dir) / CRASH_MARKER
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{os.getpid()}\n")
    return True


def build_config(args: argparse.Namespace, env: dict[str, str]) -> FakeConfig:
    values: dict[str, Any] = json.loads(env.get("FAKE_SGLANG_CONFIG_JSON") or "{}")
    values.update(model_path=args.model_path, tp_size=args.tp_size, dp_size=args.dp_size)
    optional = {
        "api_key": args.api_key,
        "reasoning_parser": args.reasoning_parser,
        "context_length": args.context_length,
        "max_running_requests": args.max_running_requests,
    }
    values.update({k: v for k, v in optional.items() if v is not None})
    if env.get("FAKE_SGLANG_STARTUP_DELAY_S"):
        values["startup_delay_s"] = float(env["FAKE_SGLANG_STARTUP_DELAY_S"])
    family = None if "family" in values else _family(args.model_path)
    if family is not None:  # outputs shaped as the model's family writes them (fake_sglang's family mode)
        values["family"] = family
    crash_after = env.get("FAKE_SGLANG_CRASH_AFTER")
    if crash_after and _crash_armed(env.get("FAKE_SGLANG_STATE_DIR")):
        values["crash_after"] = int(crash_after)
    return FakeConfig(**values)


def _family(model_path: str) -> dict[str, Any] | None:
    """The family of the tokenizer at ``model_path``, or ``None`` (random ids) when it does not load."""
    try:
        from eagle_datagen.inputs.render import load_tokenizer
        from eagle_datagen.testing.fake_sglang import family_config

        return family_config(load_tokenizer(model_path))
    except Exception:
        return None


def _spawn_child() -> None:
    """Mimic SGLang's scheduler/detokenizer processes (same process group; never reaped by us)."""
    _children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    log(DEPRECATION)
    log(
        f"server_args=ServerArgs(model_path='{args.model_path}', host='{args.host}', port={args.port}, "
        f"tp_size={args.tp_size}, dp_size={args.dp_size}, mem_fraction_static={args.mem_fraction_static}, "
        f"reasoning_parser={args.reasoning_parser!r}, device={args.device!r}, api_key={args.api_key!r}, "
        f"admin_api_key={args.admin_api_key!r})"
    )
    if env.get("FAKE_SGLANG_FAIL_AT_STARTUP") == "1":
        log("Load weight begin. avail mem=0.00 GB")
        log("Scheduler hit an exception: RuntimeError: fake startup failure (FAKE_SGLANG_FAIL_AT_STARTUP=1)")
        print("RuntimeError: fake startup failure", file=sys.stderr, flush=True)
        return 1
    config = build_config(args, env)
    _spawn_child()
    if env.get("FAKE_SGLANG_CHATTER_S"):
        pause_s = float(env["FAKE_SGLANG_CHATTER_S"])
        threading.Thread(target=chatter, args=(args.api_key, args.admin_api_key, pause_s), daemon=True).start()
    log("Load weight begin. avail mem=100.00 GB")
    progress_bar("Loading safetensors checkpoint shards", 2)
    log("Load weight end. type=FakeForCausalLM, dtype=torch.bfloat16, avail mem=90.00 GB")
    log(f"KV Cache is allocated. #tokens: {config.max_total_num_tokens}")
    draining = "received. Draining requests and shutting down..."
    code = serve(
        config,
        args.host,
        args.port,
        exit_on_crash=True,
        on_listening=lambda port: log(f"Uvicorn running on http://{args.host}:{port} (Press CTRL+C to quit)"),
        on_ready=lambda: log("The server is fired up and ready to roll!"),
        on_signal=lambda sig: log(f"{signal.Signals(sig).name} {draining}"),
    )
    log(f"stand-in exiting ({code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
