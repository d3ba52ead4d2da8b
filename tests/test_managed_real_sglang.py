"""`eagle-datagen run` launches a real SGLang 0.5.23 server on CPU, generates token-exact records, and stops it.

The command is the one a user types, plus the CPU-only server flags; the server's environment (CPU engine,
offline, test shims) comes from the CLI's own environment, which the launched server inherits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pytest

from conftest import read_records, write_jsonl
from real_sglang import SGLANG_PYTHON, hf_greedy, venv_env

pytestmark = pytest.mark.sglang

PROMPTS = [
    {"id": "q1", "prompt": "What is 2+2?"},
    {"id": "q2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]},
    {"id": "q3", "prompt": "weather in Paris and Tokyo tomorrow?"},
    {"id": "q4", "prompt": "count to five"},
    {"id": "q5", "prompt": "name a colour"},
    {"id": "q6", "prompt": "why is the sky blue?"},
]
MAX_NEW_TOKENS = 24


def live_processes(marker: str) -> list[str]:
    """Command lines of live (non-zombie) processes that mention ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != b"Z":
            found.append(cmdline)
    return found


def live_group(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            pids.append(int(name))
    return pids


def test_run_launches_real_sglang_generates_exact_ids_and_leaves_nothing(
    tmp_path: Path, sglang_venv_python: Path, tiny_kimi_model: Path
) -> None:
    model = Path(shutil.copytree(tiny_kimi_model, tmp_path / "tiny-kimi"))  # its path marks our server in /proc
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "out"
    scratch = Path(tempfile.mkdtemp(prefix="sglang-managed-"))
    env = venv_env(TMPDIR=str(scratch), XDG_CACHE_HOME=str(scratch / "cache"))
    command = [
        sys.executable, "-m", "eagle_datagen", "run", "--prompts", str(prompts), "--model", str(model),
        "--server-python", str(SGLANG_PYTHON), "--server-arg=--device=cpu", "--out", str(out),
        "--tp-size", "1", "--server-arg=--dtype=float32", "--server-arg=--max-total-tokens=8192",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--startup-timeout-s", "300", "--no-progress",
    ]  # fmt: skip
    began = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        wall_s = time.monotonic() - began
        log = (out / "server.log").read_text(errors="replace") if (out / "server.log").exists() else "(no log)"
        assert done.returncode == 0, f"{done.stderr[-4000:]}\n--- server.log ---\n{log[-4000:]}"
        print(f"managed real-SGLang run: {wall_s:.1f} s wall for {len(PROMPTS)} prompts")

        records = {r["id"]: r for r in read_records(out)}
        assert sorted(records) == sorted(p["id"] for p in PROMPTS)
        expected = hf_greedy(model, [records[p["id"]]["prompt_ids"] for p in PROMPTS], MAX_NEW_TOKENS)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            assert records[prompt["id"]]["output_ids"] == want, prompt["id"]

        manifest = orjson.loads((out / "manifest.json").read_bytes())
        assert manifest["server"]["sglang_version"] == "0.5.23"
        launched = manifest["server"]["launch_command"]
        assert launched[:3] == [str(SGLANG_PYTHON), "-m", "sglang.launch_server"]
        assert "--device=cpu" in launched and launched[launched.index("--host") + 1] == "127.0.0.1"
        assert "The server is fired up and ready to roll!" in log
        pgid = int(next(x for x in log.splitlines() if "=== eagle-datagen: process group" in x).rsplit(" ", 1)[1])
        assert live_group(pgid) == []
        assert live_processes(str(model)) == []
        assert [c for c in live_processes("eagle-datagen reaper") if f" {pgid} " in c] == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
