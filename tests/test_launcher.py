"""The managed SGLang server: its command, start-up failures, restarts, and no process left on any exit path.

The server is tests/standin/sglang/launch_server.py: the fake SGLang behind SGLang's launch flags, with one
extra child process (SGLang runs a process tree). "Nothing left" is checked by scanning /proc for live
(non-zombie) members of the server's process group, the child included.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.config import LaunchConfig
from eagle_datagen.errors import ServerError, UsageError
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.options import build_run_config
from eagle_datagen.server import launcher
from eagle_datagen.server.launcher import ManagedServer, check_server_args, launch_command, redact
from eagle_datagen.testing.fake_sglang import FakeConfig, expected_output, family_config

TESTS = Path(__file__).resolve().parent
STANDIN = TESTS / "standin"


# ----------------------------------------------------------------------------------------------------
# /proc helpers: what is still running
# ----------------------------------------------------------------------------------------------------


def _processes() -> Iterator[tuple[int, int, str, str]]:
    """(pid, pgid, state, cmdline) of every process we can read."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()
        yield int(name), int(fields[2]), fields[0].decode(), cmdline.replace(b"\0", b" ").decode(errors="replace")


def live_members(pgid: int) -> list[str]:
    """Command lines of the live processes in group ``pgid`` (zombies only wait to be reaped: not counted)."""
    return [cmd for _, group, state, cmd in _processes() if group == pgid and state != "Z"]


def live_with(marker: str) -> list[str]:
    return [cmd for _, _, state, cmd in _processes() if marker in cmd and state != "Z"]


def server_pgid(marker: str, timeout_s: float = 30.0) -> int:
    """The process group of the running stand-in whose command line contains ``marker``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid, pgid, state, cmd in _processes():
            if pid == pgid and state != "Z" and "sglang.launch_server" in cmd and marker in cmd:
                return pgid
        time.sleep(0.05)
    raise AssertionError(f"no server with {marker} in its command line")


def assert_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """The whole group, and its reaper, are gone within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (live_members(pgid) or reapers(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_members(pgid) == []
    assert reapers(pgid) == []


def reapers(pgid: int) -> list[str]:
    return [cmd for cmd in live_with("eagle-datagen reaper") if f" {pgid} " in cmd]


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def has_records(out: Path) -> bool:
    try:
        return any(path.stat().st_size > 0 for path in out.glob("shards/shard_*"))
    except FileNotFoundError:  # renamed while we looked
        return False


def log_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# ----------------------------------------------------------------------------------------------------
# The command line of the server
# ----------------------------------------------------------------------------------------------------


def test_default_launch_is_tp8_mem085_on_loopback(tmp_path: Path) -> None:
    options = {"prompts": tmp_path / "p.jsonl", "out": tmp_path / "out", "model": tmp_path / "M"}
    launch = build_run_config(options).server.launch
    assert launch is not None
    assert launch_command(launch, 31234, None) == [
        "python3", "-m", "sglang.launch_server", "--model-path", str(tmp_path / "M"), "--tp-size", "8",
        "--mem-fraction-static", "0.85", "--host", "127.0.0.1", "--port", "31234",
    ]  # fmt: skip


def test_flags_trust_remote_code_server_args_and_a_hidden_key(tmp_path: Path) -> None:
    config = LaunchConfig(
        model=Path("/models/K"),
        server_python="/envs/sglang/bin/python",
        tp_size=4,
        mem_fraction_static=0.9,
        port=30001,
        trust_remote_code=True,
        server_args=("--context-length=32768", "--enable-metrics"),
    )
    server = ManagedServer(config, tmp_path / "server.log", api_key="s3cret")
    assert server.url == "http://127.0.0.1:30001"
    assert server.command == [
        "/envs/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/K", "--tp-size", "4",
        "--mem-fraction-static", "0.9", "--host", "127.0.0.1", "--port", "30001", "--trust-remote-code",
        "--api-key", "s3cret", "--context-length=32768", "--enable-metrics",
    ]  # fmt: skip
    assert "s3cret" not in " ".join(redact(server.command))
    assert redact(["x", "--admin-api-key=abc"]) == ["x", "--admin-api-key=***"]


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--reasoning-parser=deepseek-r1", "--reasoning-parser is refused"),
        ("--reasoning-parser", "--allow-reasoning-parser"),
        ("--reasoning=qwen3", "--reasoning-parser is refused"),  # argparse would take the prefix
        ("--port=30000", "use its own option --port"),
        ("--model=/m", "use its own option --model"),
        ("--tp=2", "use its own option --tp-size"),
        ("--tensor-parallel-size=2", "use its own option --tp-size"),
        ("--api-key=k", "EAGLE_DATAGEN_API_KEY"),
        ("--context-length 4096", "--server-arg=--context-length=VALUE"),
        # D4: SGLang merges it into every request (a "stop" there cuts outputs at text)
        ('--preferred-sampling-params={"stop": ["\\n"]}', "--preferred-sampling-params is refused"),
        ("--preferred-sampling-params", "--preferred-sampling-params is refused"),
        ('--prefe={"ignore_eos": true}', "--preferred-sampling-params is refused"),
    ],
)
def test_server_args_that_are_refused(arg: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_server_args((arg,), allow_reasoning_parser=False)


def test_server_args_that_pass() -> None:
    check_server_args(
        (
            "--device=cpu",
            "--context-length",
            "4096",
            '--json-model-override-args={"a": 1}',
            "--chat-template=/a b",
            "--prefill-attention-backend=torch_native",
        ),
        allow_reasoning_parser=False,
    )
    check_server_args(("--reasoning-parser=kimi_k2",), allow_reasoning_parser=True)


def test_a_reasoning_parser_is_refused_before_anything_starts(tmp_path: Path) -> None:
    config = LaunchConfig(model=tmp_path, server_args=("--reasoning-parser", "qwen3"))
    with pytest.raises(UsageError, match="raw ids"):
        ManagedServer(config, tmp_path / "server.log")
    assert not (tmp_path / "server.log").exists()


# ----------------------------------------------------------------------------------------------------
# ManagedServer against the stand-in
# ----------------------------------------------------------------------------------------------------


def standin_config(tmp_path: Path, **changes: Any) -> LaunchConfig:
    values: dict[str, Any] = {
        "model": tmp_path / "model",
        "server_python": sys.executable,
        "tp_size": 1,
        "startup_timeout_s": 30.0,
    }
    return LaunchConfig(**{**values, **changes})


def standin_env(**knobs: str) -> dict[str, str]:
    # the stand-in imports this checkout's package (not whatever the venv has installed)
    return {"PYTHONPATH": os.pathsep.join([str(STANDIN), str(STANDIN.parents[1] / "src")]), **knobs}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def start(server: ManagedServer) -> None:
    async with httpx.AsyncClient() as http:
        await server.start(http)


def test_start_serves_and_stop_leaves_no_process(tmp_path: Path) -> None:
    server = ManagedServer(standin_config(tmp_path), tmp_path / "server.log", env=standin_env())
    fds = sorted(os.listdir("/proc/self/fd"))
    run(start(server))
    assert len(maskers(tmp_path / "server.log")) == 1
    pgid = server.pgid
    assert pgid is not None and len(live_members(pgid)) == 2  # the server and its child
    assert len(reapers(pgid)) == 1
    info = httpx.get(f"{server.url}/server_info").json()
    assert info["tp_size"] == 1 and info["model_path"] == str(tmp_path / "model")
    server.stop()
    assert_gone(pgid, timeout_s=0.5)
    assert maskers(tmp_path / "server.log") == []
    assert sorted(os.listdir("/proc/self/fd")) == fds  # no pipe end or log left open
    server.stop()  # twice is fine
    log = log_text(tmp_path / "server.log")
    assert "=== eagle-datagen: starting" in log and f"process group {pgid}" in log and "SIGTERM received" in log
    assert (tmp_path / "server.log").stat().st_mode & 0o777 == 0o600  # SGLang logs its args, the key among them


def test_a_failed_start_reports_the_log_tail_and_path(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    log_path.write_text("".join(f"old line {i}\n" for i in range(100)))
    server = ManagedServer(standin_config(tmp_path), log_path, env=standin_env(FAKE_SGLANG_FAIL_AT_STARTUP="1"))
    with pytest.raises(ServerError) as caught:
        run(start(server))
    message = str(caught.value)
    assert "exited during start-up (exit code 1)" in message
    assert f"Last 40 lines of {log_path}" in message
    assert "RuntimeError: fake startup failure" in message
    assert "old line 59" not in message and len(message.splitlines()) <= 41
    assert server.process is None


def test_no_sglang_in_server_python_says_so(tmp_path: Path) -> None:
    server = ManagedServer(standin_config(tmp_path), tmp_path / "server.log", env={"PYTHONPATH": ""})
    with pytest.raises(ServerError, match=r"SGLang is not installed for .*--server-python"):
        run(start(server))


def test_a_missing_server_python_names_the_option(tmp_path: Path) -> None:
    server = ManagedServer(standin_config(tmp_path, server_python=str(tmp_path / "nope")), tmp_path / "server.log")
    with pytest.raises(ServerError, match="point --server-python at the Python"):
        run(start(server))


def test_a_slow_start_is_waited_for(tmp_path: Path) -> None:
    server = ManagedServer(
        standin_config(tmp_path), tmp_path / "server.log", env=standin_env(FAKE_SGLANG_STARTUP_DELAY_S="1.5")
    )
    began = time.monotonic()
    with server:
        run(start(server))
        assert time.monotonic() - began >= 1.5
        assert httpx.get(f"{server.url}/health_generate").status_code == 200


def test_the_startup_timeout_stops_the_server(tmp_path: Path) -> None:
    server = ManagedServer(
        standin_config(tmp_path, startup_timeout_s=1.0),
        tmp_path / "server.log",
        env=standin_env(FAKE_SGLANG_STARTUP_DELAY_S="60"),
    )
    with pytest.raises(ServerError, match=r"not ready after 1 s \(--startup-timeout-s\)") as caught:
        run(start(server))
    assert "Uvicorn running" in str(caught.value)
    pgid = server_pgid_from_log(tmp_path / "server.log")
    assert_gone(pgid, timeout_s=0.5)


def server_pgid_from_log(path: Path) -> int:
    line = next(x for x in reversed(log_text(path).splitlines()) if "=== eagle-datagen: process group" in x)
    return int(line.rsplit(" ", 1)[1])


def test_a_port_in_use_is_refused_before_launch(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = ManagedServer(standin_config(tmp_path, port=port), tmp_path / "server.log", env=standin_env())
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            run(start(server))
    assert server.process is None


def test_children_that_ignore_sigterm_are_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM ignored by the child (inherited SIG_IGN); the leader exits; SIGKILL takes the rest of the group."""
    wrapper = tmp_path / "stubborn-python"
    wrapper.write_text(f"#!/bin/sh\ntrap '' TERM\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    server = ManagedServer(standin_config(tmp_path, server_python=str(wrapper)), tmp_path / "log", env=standin_env())
    run(start(server))
    pgid = server.pgid
    assert pgid is not None
    server.stop()
    assert_gone(pgid, timeout_s=0.5)


def test_a_process_that_left_the_group_holding_the_output_pipe_does_not_hang_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masker ends when every writer of the server's output pipe is gone; one that escaped the group (its
    own session) would keep it waiting forever: stop() ends the masker after a while, with a note."""
    monkeypatch.setattr(launcher, "KILL_WAIT_S", 0.5)
    stray_pid = tmp_path / "stray.pid"
    wrapper = tmp_path / "escaping-python"
    wrapper.write_text(
        f"#!/bin/sh\nsetsid sh -c 'echo $$ > {stray_pid}; exec sleep 60' &\nexec {sys.executable} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    log_path = tmp_path / "server.log"
    server = ManagedServer(standin_config(tmp_path, server_python=str(wrapper)), log_path, env=standin_env())
    try:
        run(start(server))
        pgid = server.pgid
        assert pgid is not None
        server.stop()
        assert_gone(pgid, timeout_s=0.5)
        assert maskers(log_path) == []
        assert "the server's output pipe is still open after 0.5 s: stopping the log masker" in log_text(log_path)
        assert "stand-in exiting (0)" in log_text(log_path)  # what it had was written before it went
    finally:
        if stray_pid.exists():
            os.kill(int(stray_pid.read_text()), signal.SIGKILL)


def test_an_exception_inside_the_with_block_stops_the_server(tmp_path: Path) -> None:
    server = ManagedServer(standin_config(tmp_path), tmp_path / "server.log", env=standin_env())
    with pytest.raises(RuntimeError, match="a bug in our code"), server:
        run(start(server))
        pgid = server.pgid
        raise RuntimeError("a bug in our code")
    assert pgid is not None
    assert_gone(pgid, timeout_s=0.5)


def test_restart_after_a_crash_comes_back_on_the_same_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "backoff_s", lambda *a, **k: 0.0)
    server = ManagedServer(standin_config(tmp_path), tmp_path / "server.log", env=standin_env())

    async def crash_and_restart() -> tuple[int, int]:
        async with httpx.AsyncClient() as http:
            await server.start(http)
            first = server.pgid
            assert first is not None
            os.killpg(first, signal.SIGKILL)
            wait_for(lambda: not server.alive(), 5, "the crash")
            assert await server.restart(http)
            assert server.pgid is not None
            return first, server.pgid

    with server:
        first, second = run(crash_and_restart())
        assert first != second and server.restarts == 1
        assert httpx.get(f"{server.url}/health_generate").status_code == 200
        assert_gone(first, timeout_s=0.5)  # the crashed server's child went with the restart
    assert_gone(second, timeout_s=0.5)
    assert "restart 1 of 3: the server crashed (killed by SIGKILL" in log_text(tmp_path / "server.log")


def test_restarts_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "backoff_s", lambda *a, **k: 0.0)
    env = standin_env()
    server = ManagedServer(standin_config(tmp_path, max_restarts=2), tmp_path / "server.log", env=env)

    async def crash_for_good() -> None:
        async with httpx.AsyncClient() as http:
            await server.start(http)
            env["FAKE_SGLANG_FAIL_AT_STARTUP"] = "1"  # every later start fails
            assert server.pgid is not None
            os.killpg(server.pgid, signal.SIGKILL)
            wait_for(lambda: not server.alive(), 5, "the crash")
            await server.restart(http)

    with pytest.raises(ServerError, match=r"crashed \(killed by SIGKILL.*then failed to start 2 time\(s\) in a row"):
        run(crash_for_good())
    log = log_text(tmp_path / "server.log")
    assert log.count("=== eagle-datagen: starting") == 3
    assert "restart 2 of 2: the server failed to start again" in log
    assert server.process is None


def test_the_reaper_stops_the_server_when_its_owner_is_killed(tmp_path: Path) -> None:
    script = (
        "import asyncio, sys, httpx\n"
        "from pathlib import Path\n"
        "from eagle_datagen.config import LaunchConfig\n"
        "from eagle_datagen.server.launcher import ManagedServer\n"
        "async def main():\n"
        f"    s = ManagedServer(LaunchConfig(model=Path({str(tmp_path / 'model')!r}), server_python=sys.executable),\n"
        f"                      Path({str(tmp_path / 'server.log')!r}), env={{'PYTHONPATH': {str(STANDIN)!r}}})\n"
        "    async with httpx.AsyncClient() as http:\n"
        "        await s.start(http)\n"
        "    print(s.pgid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pgid = int(owner.stdout.readline())
    owner.stdout.close()
    assert len(live_members(pgid)) == 2
    owner.kill()
    owner.wait()
    assert_gone(pgid, timeout_s=10)
    assert "the owner is gone; SIGTERM to process group" in log_text(tmp_path / "server.log")


# ----------------------------------------------------------------------------------------------------
# `eagle-datagen run` with a managed (stand-in) server
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path, tiny_tokenizer: Path) -> Path:
    """A per-test copy of the tiny tokenizer: its path marks this test's server in /proc."""
    return Path(shutil.copytree(tiny_tokenizer, tmp_path / "model"))


@pytest.fixture
def fake_config(hf_tokenizer: Any) -> FakeConfig:
    return FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        max_running_requests=16,
        family=family_config(hf_tokenizer),
    )


def fake_env(config: FakeConfig, **extra: Any) -> dict[str, str]:
    fields = {"vocab_size": config.vocab_size, "eos_id": config.eos_id, "max_running_requests": 16,
              "family": config.family, **extra}  # fmt: skip
    return standin_env(FAKE_SGLANG_CONFIG_JSON=orjson.dumps(fields).decode())


def cli_args(prompts: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return [
        "run", "--prompts", str(prompts), "--out", str(out), "--model", str(model),
        "--server-python", sys.executable, "--tp-size", "1", "--max-new-tokens", "32", "--no-progress", *extra,
    ]  # fmt: skip


def test_a_crash_mid_run_restarts_the_server_and_every_record_is_there_once(
    tmp_path: Path, model_dir: Path, fake_config: FakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in fake_env(fake_config, latency_s=0.002).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_SGLANG_CRASH_AFTER", "150")
    monkeypatch.setenv("FAKE_SGLANG_STATE_DIR", str(tmp_path / "state"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(400))
    out = tmp_path / "out"

    result = CliRunner().invoke(main, cli_args(prompts, out, model_dir), catch_exceptions=False)

    assert result.exit_code == 0, result.output
    records = read_records(out)
    ids = Counter(r["id"] for r in records)
    assert sorted(ids) == sorted(row.key for row in PromptReader(prompts))
    assert set(ids.values()) == {1}
    sampling = {"max_new_tokens": 32, "temperature": 0.0}
    for record in records:
        assert record["output_ids"] == expected_output(fake_config, record["prompt_ids"], sampling)
    log = log_text(out / "server.log")
    assert log.count("=== eagle-datagen: starting") == 2
    assert log.count("The server is fired up and ready to roll!") == 2
    assert "restart 1 of 3: the server crashed (exit code 1)" in log
    assert (tmp_path / "state" / "fake-sglang-crashed-once").exists()
    assert live_with(str(model_dir)) == []


def test_an_exception_in_our_code_stops_the_server(
    tmp_path: Path, model_dir: Path, fake_config: FakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in fake_env(fake_config).items():
        monkeypatch.setenv(key, value)

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in our code")

    monkeypatch.setattr("eagle_datagen.app.read_server_facts", broken)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(4))
    result = CliRunner().invoke(main, cli_args(prompts, tmp_path / "out", model_dir), catch_exceptions=False)
    assert result.exit_code == 1 and "unexpected RuntimeError: a bug in our code" in result.output
    assert_gone(server_pgid_from_log(tmp_path / "out" / "server.log"), timeout_s=0.5)
    assert live_with(str(model_dir)) == []


@pytest.mark.parametrize(
    ("sig", "phase", "exit_codes"),
    [
        (signal.SIGINT, "running", {130}),
        (signal.SIGTERM, "running", {130}),
        (signal.SIGKILL, "running", {-signal.SIGKILL}),
        (signal.SIGINT, "starting", {130}),
        # The handlers are in place from before the launch, so start-up stops cleanly too (the reaper remains
        # the safety net for a SIGKILL).
        (signal.SIGTERM, "starting", {130}),
    ],
)
def test_a_signal_to_the_cli_leaves_no_process(
    tmp_path: Path, model_dir: Path, fake_config: FakeConfig, sig: signal.Signals, phase: str, exit_codes: set[int]
) -> None:
    knobs: dict[str, str] = {}
    if phase == "starting":
        knobs["FAKE_SGLANG_STARTUP_DELAY_S"] = "60"
    env = {**os.environ, **fake_env(fake_config, time_per_token_s=0.005), **knobs}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(2000))
    out = tmp_path / "out"
    args = cli_args(prompts, out, model_dir, "--grace-period-s", "5", "--checkpoint-records", "20")
    cli = subprocess.Popen(
        [sys.executable, "-m", "eagle_datagen", *args],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        pgid = server_pgid(str(model_dir))
        if phase == "running":
            wait_for(lambda: has_records(out), 30, "the first records")
        else:
            wait_for(lambda: "Uvicorn running" in log_text(out / "server.log"), 30, "the server to listen")
        cli.send_signal(sig)
        _, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode in exit_codes, stderr.decode(errors="replace")[-3000:]
    assert_gone(pgid, timeout_s=launcher.STOP_WAIT_S + 5)
    assert live_with(str(model_dir)) == []
    wait_for(lambda: maskers(out / "server.log") == [], 10, "the log masker to end")  # at EOF, on its own


def test_the_launched_server_gets_the_users_environment_unchanged(tmp_path: Path, model_dir: Path) -> None:
    """D15: loading the tokenizer used to set HF_HUB_OFFLINE=1 and TRANSFORMERS_VERBOSITY=error in our own
    environment, which the launched server inherited (it then could not fetch from the Hub, and its
    transformers warnings were hidden from server.log)."""
    dump = tmp_path / "server-env.txt"
    server_python = tmp_path / "envdump-python.sh"
    server_python.write_text(f"#!/bin/sh\nenv > '{dump}'\nexit 1\n")
    server_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY")}
    env["EAGLE_TEST_USER_VARIABLE"] = "kept as is"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(2))
    args = [
        "run", "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--model", str(model_dir),
        "--server-python", str(server_python), "--tp-size", "1", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "eagle_datagen", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "exited during start-up" in done.stderr, done.stderr[-2000:]
    got = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert "HF_HUB_OFFLINE" not in got and "TRANSFORMERS_VERBOSITY" not in got
    assert got["EAGLE_TEST_USER_VARIABLE"] == "kept as is"


# ----------------------------------------------------------------------------------------------------
# Secrets in the server's own output (D9): it reaches server.log only through the log masker
# ----------------------------------------------------------------------------------------------------

API_KEY = "sk-LIVE-6f1c2a9e4b7d"
ADMIN_KEY = "ADMIN-SECRET-93d0e1"


def maskers(log_path: Path) -> list[str]:
    """Command lines of the live log maskers writing ``log_path``."""
    return [cmd for cmd in live_with("logmask.py") if str(log_path) in cmd]


def test_a_launched_server_prints_its_keys_and_server_log_shows_them_masked(
    tmp_path: Path, model_dir: Path, fake_config: FakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang prints ``server_args=ServerArgs(... api_key='…', admin_api_key='…')`` at start-up (the stand-in
    too); that line went into server.log as it was, keys included."""
    for key, value in fake_env(fake_config).items():
        monkeypatch.setenv(key, value)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(4))
    out = tmp_path / "out"
    args = cli_args(prompts, out, model_dir, "--api-key", API_KEY, f"--server-arg=--admin-api-key={ADMIN_KEY}")

    result = CliRunner().invoke(main, args, catch_exceptions=False)

    assert result.exit_code == 0, result.output
    assert len(read_records(out)) == 4  # the server wanted the key, and got it
    log = (out / "server.log").read_bytes()
    for secret in (API_KEY, ADMIN_KEY):
        assert secret not in result.output
        assert [p for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []
    # The rest of the line is there byte for byte; so is the progress bar, \r and all.
    assert (
        f"server_args=ServerArgs(model_path='{model_dir}', host='127.0.0.1', port=".encode() in log
        and b"reasoning_parser=None, device=None, api_key='***', admin_api_key='***')\n" in log
    )
    bar = "\r".join(f"Loading safetensors checkpoint shards: {p:3d}% Completed | {d}/2 [00:00<00:00]"
                    for d, p in ((0, 0), (1, 50), (2, 100)))  # fmt: skip
    assert f"\r{bar}\n".encode() in log
    assert b"SIGTERM received. Draining requests and shutting down..." in log and b"stand-in exiting (0)" in log
    assert maskers(out / "server.log") == []
    assert live_with(str(model_dir)) == []


def test_the_masker_outlives_a_killed_owner_until_the_reaper_has_stopped_the_server(tmp_path: Path) -> None:
    """kill -9 of eagle-datagen: the masker, not a thread of ours, keeps copying (masked) while the reaper stops
    the server, so the server neither dies of SIGPIPE nor loses its last lines. The stand-in keeps printing
    lines with both keys, each cut in two writes in the middle of the API key."""
    log_path = tmp_path / "server.log"
    script = (
        "import asyncio, sys, httpx\n"
        "from pathlib import Path\n"
        "from eagle_datagen.config import LaunchConfig\n"
        "from eagle_datagen.server.launcher import ManagedServer\n"
        "async def main():\n"
        f"    config = LaunchConfig(model=Path({str(tmp_path / 'model')!r}), server_python=sys.executable,\n"
        f"                          server_args=('--admin-api-key', {ADMIN_KEY!r}))\n"
        f"    s = ManagedServer(config, Path({str(log_path)!r}), api_key={API_KEY!r},\n"
        f"                      env={standin_env(FAKE_SGLANG_CHATTER_S='0.3')!r})\n"
        "    async with httpx.AsyncClient() as http:\n"
        "        await s.start(http)\n"
        "    print(s.pgid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pgid = int(owner.stdout.readline())
    owner.stdout.close()
    # The secrets went to the masker through a pipe: no command line of ours shows them.
    for cmd in maskers(log_path) + reapers(pgid):
        assert API_KEY not in cmd and ADMIN_KEY not in cmd
    wait_for(lambda: log_text(log_path).count("chatter ") >= 2, 30, "the stand-in's chatter")
    owner.kill()
    owner.wait()
    assert_gone(pgid, timeout_s=launcher.STOP_WAIT_S + 5)
    wait_for(lambda: maskers(log_path) == [], 10, "the masker to end")

    log = log_path.read_bytes()
    assert API_KEY.encode() not in log and ADMIN_KEY.encode() not in log
    assert API_KEY[: len(API_KEY) // 2].encode() not in log  # not even the half written before the pause
    after = log.split(b"the owner is gone; SIGTERM to process group", 1)[1]
    # Written after the owner died, so only the masker can have copied them: the drain, the end, both whole.
    assert b"SIGTERM received. Draining requests and shutting down..." in after
    assert b"stand-in exiting (0)\n" in after
    # The reaper appends its lines itself: one may land inside a chatter line the masker has flushed half of
    # (a partial line goes out after a quiet moment; the half-written key is held back).
    ours = re.sub(rb"eagle-datagen reaper: [^\n]*\n", b"", log)
    chatter = [line for line in ours.split(b"\n") if b"chatter " in line]
    assert len(chatter) >= 2
    for line in chatter[:-1]:  # the last one may have been cut off by the exit
        assert line.split(b": ", 1)[1] == b"api_key='***' admin_api_key='***' \xff"
