"""Real SGLang 0.5.23 on CPU prints its resolved server args, `api_key` and `admin_api_key` included, at start-up;
launched by `eagle-datagen run`, its server.log shows them as `***` (D9).

The command is the one a user types with both keys, plus the CPU-only server flags (as in
test_managed_real_sglang.py, whose fixtures it reuses).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import read_records, write_jsonl
from real_sglang import SGLANG_PYTHON, venv_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

API_KEY = "sk-REAL-4c1d9e7a2b"
ADMIN_KEY = "ADMIN-REAL-8f3e6d"


def test_real_sglang_prints_its_keys_and_server_log_shows_them_masked(
    tmp_path: Path, sglang_venv_python: Path, tiny_kimi_model: Path
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "q1", "prompt": "What is 2+2?"}])
    out = tmp_path / "out"
    scratch = Path(tempfile.mkdtemp(prefix="sglang-logmask-"))
    env = venv_env(TMPDIR=str(scratch), XDG_CACHE_HOME=str(scratch / "cache"))
    command = [
        sys.executable, "-m", "eagle_datagen", "run", "--prompts", str(prompts), "--model", str(tiny_kimi_model),
        "--server-python", str(SGLANG_PYTHON), "--server-arg=--device=cpu", "--out", str(out),
        "--tp-size", "1", "--server-arg=--dtype=float32", "--server-arg=--max-total-tokens=8192",
        "--api-key", API_KEY, f"--server-arg=--admin-api-key={ADMIN_KEY}",
        "--max-new-tokens", "4", "--startup-timeout-s", "300", "--no-progress",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        log = (out / "server.log").read_bytes() if (out / "server.log").exists() else b"(no log)"
        assert done.returncode == 0, f"{done.stderr[-4000:]}\n--- server.log ---\n{log[-4000:]!r}"
        assert len(read_records(out)) == 1
        # SGLang 0.5.23 logs `server_args={...}` (a dict) with both keys in it; both come out masked.
        args_line = next(line for line in log.splitlines() if b"server_args=" in line)
        assert b"'api_key': '***'" in args_line and b"'admin_api_key': '***'" in args_line, args_line[:2000]
        assert f"'model_path': '{tiny_kimi_model}'".encode() in args_line
        for secret in (API_KEY, ADMIN_KEY):
            assert secret not in done.stdout + done.stderr
            assert [p for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
