"""sglang-router 0.3.2 (the real one, from .venv-sglang) in front of workers: detected, its workers' facts read
and checked, settings it would drop refused, launched as a managed child, and not one id changed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from click.testing import CliRunner

from conftest import python_with_env, read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.server.launcher import group_alive
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, expected_output, family_config
from real_sglang import SGLANG_PYTHON, free_port, log_tail, start_sglang_server, venv_env

pytestmark = pytest.mark.sglang

ROUTER_READY_S = 120.0


@pytest.fixture(autouse=True)
def _needs_router(sglang_venv_python: Path) -> None:
    probe = subprocess.run(
        [str(SGLANG_PYTHON), "-c", "import sglang_router"], env=venv_env(), capture_output=True, check=False
    )
    if probe.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("sglang-router is not installed in .venv-sglang (requirements/sglang-cpu.txt pins it)")
        pytest.skip("sglang-router is not installed in .venv-sglang")


@contextlib.contextmanager
def router_over(worker_urls: list[str], log_path: Path) -> Iterator[str]:
    """A real sglang-router over ``worker_urls``; yields its URL, stops it (and its group) on exit."""
    port, metrics = free_port(), free_port()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [str(SGLANG_PYTHON), "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
             "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(metrics)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=venv_env(), start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_READY_S
        while True:
            assert process.poll() is None, log_tail(log_path)
            with contextlib.suppress(httpx.HTTPError, ValueError):
                # Healthy before its workers are registered: wait until /workers lists them all.
                listed = {w["url"] for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"]}
                if listed >= set(worker_urls):
                    break
            assert time.monotonic() < deadline, f"router not ready:\n{log_tail(log_path)}"
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture
def two_fakes(hf_tokenizer: Any) -> Iterator[list[Any]]:
    config = FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        max_running_requests=8,
        family=family_config(hf_tokenizer),
    )
    servers = [FakeSGLangServer(config).start(), FakeSGLangServer(config).start()]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def router_python(tmp_path: Path) -> str:
    """.venv-sglang's Python with the CPU shims, as the environment of a node would provide them."""
    shims = venv_env()["PYTHONPATH"]
    return python_with_env(tmp_path / "router-python", SGLANG_PYTHON, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=shims)


def run(prompts: Path, out: Path, tokenizer: Path, *args: str) -> Any:
    return CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer), "--no-progress",
         "--max-new-tokens", "24", *args],
        catch_exceptions=False,
    )  # fmt: skip


def test_attached_router_is_detected_and_changes_no_id(
    tmp_path: Path, tiny_tokenizer: Path, two_fakes: list[Any]
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(40))
    with router_over([s.url for s in two_fakes], tmp_path / "router.log") as router_url:
        result = run(prompts, tmp_path / "via-router", tiny_tokenizer, "--server-url", router_url)
    assert result.exit_code == 0, result.output
    direct = run(prompts, tmp_path / "direct", tiny_tokenizer, "--server-url", two_fakes[0].url)
    assert direct.exit_code == 0, direct.output

    via = {r["id"]: r for r in read_records(tmp_path / "via-router")}
    assert via == {r["id"]: r for r in read_records(tmp_path / "direct")} and len(via) == 40
    sampling = {"max_new_tokens": 24, "temperature": 0.0}
    for record in via.values():
        assert record["output_ids"] == expected_output(two_fakes[0].config, record["prompt_ids"], sampling)
    # Round robin: both workers did work, so both really sat behind the router.
    assert all(s.stats()["generate_responses"] > 0 for s in two_fakes)
    facts = orjson.loads((tmp_path / "via-router" / "manifest.json").read_bytes())["server"]["facts"][0]
    assert sorted(facts["router_workers"]) == sorted(s.url for s in two_fakes)
    assert facts["max_running_requests"] == 16  # the workers' sum
    assert facts["model_path"] == "fake-org/fake-model"


def test_a_setting_the_router_drops_is_refused_and_the_advice_works(
    tmp_path: Path, tiny_tokenizer: Path, two_fakes: list[Any]
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(8))
    extra = ("--sampling-params", '{"frequency_penalty": 0.5}')
    with router_over([s.url for s in two_fakes], tmp_path / "router.log") as router_url:
        result = run(prompts, tmp_path / "o", tiny_tokenizer, "--server-url", router_url, *extra)
    assert result.exit_code == 2, result.output
    assert "drops the sampling_params frequency_penalty" in result.output
    advice = result.output.split("Attach to the workers instead: ")[1].split()
    assert advice[::2] == ["--server-url", "--server-url"]  # in the router's order, which is its own
    assert sorted(advice[1::2]) == sorted(s.url for s in two_fakes)
    followed = run(prompts, tmp_path / "o2", tiny_tokenizer, *advice, *extra)
    assert followed.exit_code == 0, followed.output


def test_a_seed_or_a_mix_variant_the_router_would_drop_is_refused(
    tmp_path: Path, tiny_tokenizer: Path, two_fakes: list[Any]
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(4))
    with router_over([s.url for s in two_fakes], tmp_path / "router.log") as router_url:
        seeded = run(prompts, tmp_path / "a", tiny_tokenizer, "--server-url", router_url, "--seed", "7")
        mixed = run(
            prompts, tmp_path / "b", tiny_tokenizer, "--server-url", router_url,
            "--mix-entry", 'plain:0.5:{}', "--mix-entry", 'penalised:0.5:{"sampling": {"presence_penalty": 0.5}}',
        )  # fmt: skip
    assert seeded.exit_code == 2 and "drops the sampling_params sampling_seed" in seeded.output
    assert mixed.exit_code == 2 and "drops the sampling_params presence_penalty" in mixed.output


def test_workers_of_different_models_are_refused(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    base = {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id}
    a = FakeSGLangServer(FakeConfig(**base)).start()
    b = FakeSGLangServer(FakeConfig(**base, model_path="other-org/other-model")).start()
    try:
        prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(4))
        with router_over([a.url, b.url], tmp_path / "router.log") as router_url:
            result = run(prompts, tmp_path / "o", tiny_tokenizer, "--server-url", router_url)
    finally:
        a.stop()
        b.stop()
    assert result.exit_code == 1, result.output
    assert "differ in model_path" in result.output and "other-org/other-model" in result.output


def test_launch_router_is_a_managed_child(
    tmp_path: Path, tiny_tokenizer: Path, two_fakes: list[Any], router_python: str
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(30))
    out = tmp_path / "o"
    args = [a for s in two_fakes for a in ("--server-url", s.url)]
    result = run(prompts, out, tiny_tokenizer, *args, "--launch-router", "--router-python", router_python)
    assert result.exit_code == 0, result.output
    assert "starting sglang-router" in result.output
    records = read_records(out)
    assert len(records) == 30
    sampling = {"max_new_tokens": 24, "temperature": 0.0}
    assert all(r["output_ids"] == expected_output(two_fakes[0].config, r["prompt_ids"], sampling) for r in records)
    log = (out / "router.log").read_text()
    pgid = int(log.split("process group ")[1].split()[0])
    assert not group_alive(pgid)  # stopped with the run, nothing left behind
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert "sglang_router.launch_router" in manifest["server"]["launch_command"]


@pytest.mark.slow
def test_two_real_sglang_servers_behind_the_router_give_the_records_of_one(
    tmp_path: Path, tiny_kimi_model: Path, sglang_server: Any, router_python: str
) -> None:
    """The real thing: sglang-router 0.3.2 over two SGLang 0.5.23 CPU servers, launched by --launch-router."""
    rows = [{"id": f"r{i}", "prompt": f"count {i} sheep, then {i + 1}"} for i in range(16)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    common = ("--tokenizer", str(tiny_kimi_model), "--max-new-tokens", "12", "--no-progress", "--trust-remote-code")
    with start_sglang_server(tiny_kimi_model, log_path=tmp_path / "second.log") as second:
        routed = CliRunner().invoke(
            main,
            ["run", "--prompts", str(prompts), "--out", str(tmp_path / "routed"), *common,
             "--server-url", sglang_server.url, "--server-url", second.url,
             "--launch-router", "--router-python", router_python, "--router-policy", "round_robin"],
            catch_exceptions=False,
        )  # fmt: skip
    assert routed.exit_code == 0, routed.output
    direct = CliRunner().invoke(
        main,
        [
            "run",
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "direct"),
            *common,
            "--server-url",
            sglang_server.url,
        ],
        catch_exceptions=False,
    )
    assert direct.exit_code == 0, direct.output
    via = {r["id"]: r for r in read_records(tmp_path / "routed")}
    assert via == {r["id"]: r for r in read_records(tmp_path / "direct")} and len(via) == 16


def test_turns_all_through_a_router_gives_the_records_of_one_server(
    tmp_path: Path, tiny_tokenizer: Path, two_fakes: list[Any]
) -> None:
    """--turns all behind sglang-router: every turn's /generate goes through the router, the parser calls to one
    of its workers (a router is not asked to pass them on), and the records are those of one server."""
    conversations = [
        {"id": f"c{i}", "messages": [m for u in range(1 + i % 3) for m in (
            {"role": "user", "content": f"question {u} of {i}"}, {"role": "assistant", "content": "source"})]}
        for i in range(12)
    ]  # fmt: skip
    prompts = write_jsonl(tmp_path / "convs.jsonl", conversations)
    turns = ["--turns", "all", "--reasoning-parser-name", "kimi_k2", "--max-new-tokens", "128"]
    with router_over([s.url for s in two_fakes], tmp_path / "router.log") as router_url:
        probe = httpx.post(f"{router_url}/separate_reasoning", json={"text": "x", "reasoning_parser": "kimi_k2"})
        result = run(prompts, tmp_path / "via-router", tiny_tokenizer, "--server-url", router_url, *turns)
    assert result.exit_code == 0, result.output
    # The router answers 404 to the parser endpoints (measured): the run parses on one of its workers instead.
    assert probe.status_code == 404
    parsed_on = [sum(s.stats()["parser_calls"].values()) for s in two_fakes]
    assert sum(parsed_on) >= 24 + 1  # every turn, and the probe at the start
    direct = run(prompts, tmp_path / "direct", tiny_tokenizer, "--server-url", two_fakes[0].url, *turns)
    assert direct.exit_code == 0, direct.output
    via = {r["id"]: r for r in read_records(tmp_path / "via-router")}
    assert via == {r["id"]: r for r in read_records(tmp_path / "direct")} and len(via) == 24
    assert all(s.stats()["generate_responses"] > 0 for s in two_fakes)
