"""``--dp-size``: SGLang data parallelism on a launched server (against the stand-in, whose facts follow
SGLang's: ``internal_states`` per DP rank), and the default concurrency following all replicas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from conftest import python_with_env, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.server.facts import default_concurrency, read_server_facts
from eagle_datagen.server.launcher import ManagedServer, check_server_args, launch_command
from test_launcher import standin_config, standin_env


def test_dp_size_reaches_the_launch_command_and_its_own_flag_is_refused(tmp_path: Path) -> None:
    command = launch_command(standin_config(tmp_path, dp_size=4, tp_size=2), 30000, None)
    assert command[command.index("--dp-size") + 1] == "4" and command[command.index("--tp-size") + 1] == "2"
    assert "--dp-size" not in launch_command(standin_config(tmp_path), 30000, None)
    for flag in ("--dp-size=2", "--dp", "--data-parallel-size=2"):
        with pytest.raises(UsageError, match="use its own option --dp-size"):
            check_server_args((flag,), allow_reasoning_parser=False)


def test_facts_of_a_two_replica_server_count_both(tmp_path: Path) -> None:
    config = standin_config(tmp_path, dp_size=2, server_args=("--max-running-requests=24",))
    server = ManagedServer(config, tmp_path / "server.log", env=standin_env())

    async def facts() -> Any:
        async with httpx.AsyncClient() as http:
            await server.start(http)
            try:
                return await read_server_facts(http, server.url)
            finally:
                server.stop()

    got = asyncio.run(facts())
    assert got.args["dp_size"] == 2
    assert got.max_running_requests == 48  # 24 per replica, two replicas
    assert default_concurrency([got.max_running_requests]) == 48 + 12


def test_run_launches_with_dp_size(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    import json
    import sys

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"k{i}", "prompt": f"q {i}"} for i in range(12)])
    fake = json.dumps({"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id})
    wrapper = python_with_env(
        tmp_path / "standin-python", sys.executable,
        PYTHONPATH=standin_env()["PYTHONPATH"], FAKE_SGLANG_CONFIG_JSON=fake,
    )  # fmt: skip
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--model", str(tmp_path / "model"),
         "--tokenizer", str(tiny_tokenizer), "--server-python", wrapper, "--tp-size", "1", "--dp-size", "2",
         "--server-arg=--max-running-requests=8", "--no-progress", "--max-new-tokens", "8"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--dp-size 2" in result.output
    assert "concurrency 24 (from the servers' max_running_requests)" in result.output  # 2 x 8, plus headroom


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_two_replica_sglang_on_cpu(tmp_path: Path, sglang_venv_python: Path, tiny_kimi_model: Path) -> None:
    """`--dp-size 2` launches real SGLang 0.5.23 with two data-parallel schedulers on this CPU (one core each:
    SGLang's CPU backend needs SGLANG_CPU_OMP_THREADS_BIND for more ranks than NUMA nodes), the default
    concurrency counts both replicas, and the records are transformers' greedy ids."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from conftest import read_records
    from real_sglang import SGLANG_PYTHON, hf_greedy, venv_env

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"d{i}", "prompt": f"count {i} apples"} for i in range(6)])
    out = tmp_path / "out"
    scratch = Path(tempfile.mkdtemp(prefix="sglang-dp-"))
    cores = os.sched_getaffinity(0)
    bind = "|".join(str(c) for c in sorted(cores)[:2]) if len(cores) >= 2 else "0|0"
    env = venv_env(TMPDIR=str(scratch), XDG_CACHE_HOME=str(scratch / "cache"), SGLANG_CPU_OMP_THREADS_BIND=bind)
    command = [
        sys.executable, "-m", "eagle_datagen", "run", "--prompts", str(prompts), "--model", str(tiny_kimi_model),
        "--trust-remote-code", "--server-python", str(SGLANG_PYTHON), "--tp-size", "1", "--dp-size", "2",
        "--server-arg=--device=cpu", "--server-arg=--dtype=float32", "--server-arg=--max-total-tokens=8192",
        "--server-arg=--sleep-on-idle", "--max-new-tokens", "12", "--startup-timeout-s", "400", "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        log = (out / "server.log").read_text(errors="replace") if (out / "server.log").exists() else "(no log)"
        assert done.returncode == 0, f"{done.stderr[-3000:]}\n--- server.log ---\n{log[-3000:]}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert "--dp-size 2" in done.stderr
    facts = json.loads((out / "manifest.json").read_text())["server"]["facts"][0]
    assert facts["args"]["dp_size"] == 2
    per_rank = facts["max_running_requests"] // 2
    assert f"concurrency {default_concurrency([2 * per_rank])}" in done.stderr
    records = {r["id"]: r for r in read_records(out)}
    ids = sorted(records)
    assert len(ids) == 6
    expected = hf_greedy(tiny_kimi_model, [records[i]["prompt_ids"] for i in ids], 12)
    assert [records[i]["output_ids"] for i in ids] == expected
