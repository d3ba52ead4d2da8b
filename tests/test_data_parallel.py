"""``--dp-size``: SGLang data parallelism on a launched server (against the stand-in, whose facts follow
SGLang's: ``internal_states`` per DP rank), and the default concurrency following all replicas."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from conftest import write_jsonl
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
    wrapper = tmp_path / "standin-python"
    env = standin_env()
    fake = json.dumps({"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id})
    wrapper.write_text(
        f"#!/bin/sh\nexport PYTHONPATH={env['PYTHONPATH']} FAKE_SGLANG_CONFIG_JSON='{fake}'\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--model", str(tmp_path / "model"),
         "--tokenizer", str(tiny_tokenizer), "--server-python", str(wrapper), "--tp-size", "1", "--dp-size", "2",
         "--server-arg=--max-running-requests=8", "--no-progress", "--max-new-tokens", "8"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--dp-size 2" in result.output
    assert "concurrency 24 (from the servers' max_running_requests)" in result.output  # 2 x 8, plus headroom
