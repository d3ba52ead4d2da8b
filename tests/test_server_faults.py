"""Back-pressure is not an outage (review D6), and a poison prompt is found and set aside (review D7).

The fault tests run against the fake SGLang; the crash-loop one also against the launched stand-in
(tests/standin), which exits like SGLang does on an input id its model does not have.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import RequestFailed
from eagle_datagen.generate.pool import CrashLedger, Endpoint, ServerPool, counts_toward_down
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config

STANDIN = Path(__file__).resolve().parent / "standin"
POISON = {"id": "poison", "prompt": "call <|tool_calls_section_begin|> now"}  # renders the tokenizer's last id


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "prompt": f"question number {i}: what is {i} plus {i}?"} for i in range(n)]


def run_args(prompts: Path, out: Path, tokenizer: Path, url: str, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
            "--server-url", url, "--no-progress", "--max-new-tokens", "16", *extra]  # fmt: skip


def config_for(hf_tokenizer: Any, **changes: Any) -> FakeConfig:
    base = {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id, "max_running_requests": 8,
            "family": family_config(hf_tokenizer)}  # fmt: skip
    return FakeConfig(**{**base, **changes})


# ----------------------------------------------------------------------------------------------------
# D6: 503 "queue full" and 429 slow dispatch down; they never mark the server down
# ----------------------------------------------------------------------------------------------------


def test_queue_full_503s_slow_dispatch_and_cancel_nothing(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """D6: SGLang with --max-queued-requests answers 503 while it is busily generating; 5 in a row used to mark
    it down, cancelling (and throwing away) every generation it was running, over and over."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(120))
    # 8 slots and room for 2 waiting: the default concurrency (8 + 8) overloads it
    fake = config_for(hf_tokenizer, capacity=8, max_queued_requests=2, latency_s=0.05, error_503_rate=0.1, seed=3)
    with FakeSGLangServer(fake) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
        stats = server.stats()
    assert result.exit_code == 0, result.output
    assert stats["queue_full"] > 10 and stats["faults_503"] > 0  # it was overloaded, and said so
    assert "is down" not in caplog.text
    assert "requeued after a server went down: 0" in result.output
    assert len(read_records(tmp_path / "out")) == 120
    # nothing generated was thrown away: every generation started became a response
    assert stats["generate_items"] == stats["generate_responses"] == 121  # the preflight too


def test_retry_after_is_honoured_and_429_is_not_an_outage(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A router's 429 (with Retry-After) used to fail the preflight, and mid-run it counted toward an outage."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(60))
    with FakeSGLangServer(config_for(hf_tokenizer, error_429_rate=1.0, retry_after_s=1)) as server:
        calm = threading.Timer(2.5, server.update_config, kwargs={"error_429_rate": 0.0})
        calm.start()
        started = time.monotonic()
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
        calm.join()
        stats = server.stats()
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started >= 2.5
    # one request at a time (the preflight), once per Retry-After second: about 3 answers of 429, not dozens
    assert 2 <= stats["faults_429"] <= 4, stats["faults_429"]
    assert "is down" not in caplog.text
    assert len(read_records(tmp_path / "out")) == 60


def test_what_counts_toward_an_outage() -> None:
    def failed(kind: str, status: int | None = None) -> RequestFailed:
        return RequestFailed(kind, "x", retryable=True, status=status)

    assert counts_toward_down(failed("connection")) and counts_toward_down(failed("timeout"))
    assert counts_toward_down(failed("http_500", 500)) and counts_toward_down(failed("http_502", 502))
    assert not counts_toward_down(failed("http_503", 503)) and not counts_toward_down(failed("http_429", 429))
    assert not counts_toward_down(failed("bad_response")) and not counts_toward_down(failed("check_abort"))


def test_backpressure_lowers_the_target_to_what_the_server_runs_and_recovers() -> None:
    async def scenario() -> list[float | None]:
        endpoint = Endpoint("http://a", max_running_requests=8)

        async def never(_: Endpoint) -> bool:
            return False

        pool = ServerPool([endpoint], never)
        seen: list[float | None] = []
        held = [await pool.acquire() for _ in range(20)]
        pool.release(held.pop())
        pool.backpressure(endpoint, None, 1)  # 19 in flight and this one: cut to 15
        seen.append(endpoint.limit)
        endpoint.last_cut -= 10
        for _ in range(10):
            pool.release(held.pop())
        pool.backpressure(endpoint, None, 1)  # 9 in flight: cut to 7.5, but never below the 8 it runs
        seen.append(endpoint.limit)
        pool.succeeded(endpoint)
        seen.append(endpoint.limit)
        assert endpoint.up and endpoint.consecutive_failures == 0
        return seen

    import asyncio

    assert asyncio.run(scenario()) == [15.0, 8.0, 9.0]


# ----------------------------------------------------------------------------------------------------
# D7: a request in flight at consecutive crashes is sent alone; if the server dies again it is set aside
# ----------------------------------------------------------------------------------------------------


def test_the_crash_ledger_charges_consecutive_crashes() -> None:
    ledger = CrashLedger(suspect_after=2)
    ledger.charge({"a", "b", "poison"})
    assert not ledger.suspect("poison")
    ledger.cleared("a")  # a finished: innocent
    ledger.charge({"a", "poison"})
    assert ledger.suspect("poison") and not ledger.suspect("a") and not ledger.suspect("b")
    ledger.charge({"poison"}, alone="poison")
    assert ledger.culprits == {"poison": 3} and not ledger.suspect("poison")
    ledger.charge({"b"})  # b was not in flight at the crash before: it starts again at 1
    assert ledger.crashes_with("b") == 1


def _supervise(server: FakeSGLangServer, stop: threading.Event, delay_s: float = 0.3) -> threading.Thread:
    """What systemd or Kubernetes does for an attached server: bring it back after each crash."""

    def loop() -> None:
        while not stop.is_set():
            if not server.is_up:
                time.sleep(delay_s)
                server.come_up()
            time.sleep(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_a_poison_prompt_on_an_attached_server_is_set_aside_and_the_run_goes_on(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """D7: the request that crashes the server used to be requeued uncharged after every crash, forever."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [*rows(60), POISON])
    # the served vocabulary ends one id short of the tokenizer's: that id crashes the server, as in SGLang
    fake = config_for(hf_tokenizer, vocab_size=len(hf_tokenizer) - 1, latency_s=0.02)
    stop = threading.Event()
    out = tmp_path / "out"
    with FakeSGLangServer(fake) as server:
        supervisor = _supervise(server, stop)
        try:
            result = invoke(*run_args(prompts, out, tiny_tokenizer, server.url))
            crashes = server.stats()["crashes"]
            # resume retries it, alone from the start: one more crash, not three
            deadline = time.monotonic() + 10
            while not server.is_up and time.monotonic() < deadline:  # back from the last crash
                time.sleep(0.05)
            resumed = invoke("resume", "--out", str(out), "--no-progress")
            crashes_on_resume = server.stats()["crashes"] - crashes
        finally:
            stop.set()
            supervisor.join(5)
    assert result.exit_code == 3, result.output  # finished, with a failure
    failures = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert [(f["id"], f["kind"]) for f in failures[:1]] == [("poison", "server_crash")]
    assert "3 crashes in a row, the last while it ran alone" in failures[0]["message"]
    assert crashes == 3
    assert sorted(r["id"] for r in read_records(out)) == sorted(f"p{i}" for i in range(60))
    assert resumed.exit_code == 3, resumed.output
    assert crashes_on_resume == 1
    again = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert [(f["id"], f["kind"]) for f in again][-1] == ("poison", "server_crash")


def test_a_poison_prompt_crash_looping_a_launched_server_is_set_aside(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D7 with the managed server: it was relaunched until --max-restarts ran out ("restart(s) in a row failed",
    though every restart had worked), and the poison prompt was in neither failures.jsonl nor rejects.jsonl."""
    fake = {"vocab_size": len(hf_tokenizer) - 1, "eos_id": hf_tokenizer.eos_token_id, "max_running_requests": 4,
            "family": family_config(hf_tokenizer)}  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), str(STANDIN.parents[1] / "src")]))
    monkeypatch.setenv("FAKE_SGLANG_CONFIG_JSON", orjson.dumps({**fake, "latency_s": 0.02}).decode())
    monkeypatch.setattr("eagle_datagen.server.launcher.backoff_s", lambda *a, **k: 0.0)
    model = Path(shutil.copytree(tiny_tokenizer, tmp_path / "model"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [*rows(30), POISON])
    out = tmp_path / "out"
    args = ["run", "--prompts", str(prompts), "--out", str(out), "--model", str(model), "--server-python",
            sys.executable, "--tp-size", "1", "--max-new-tokens", "16", "--no-progress", "--max-restarts", "2"]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 3, result.output
    failures = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert [(f["id"], f["kind"]) for f in failures] == [("poison", "server_crash")]
    assert sorted(r["id"] for r in read_records(out)) == sorted(f"p{i}" for i in range(30))
    log = (out / "server.log").read_text()
    # crash 1 and 2 use the budget (2); the third, explained by the poison running alone, does not
    assert log.count("=== eagle-datagen: starting") == 4
    assert "restart 2 of 2: the server crashed (exit code 1)" in log
    assert "restart not counted: explained: the server crashed (exit code 1)" in log
    assert "restart(s) in a row failed" not in result.output


def test_a_poison_prompt_that_is_the_preflight_does_not_stop_the_run(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """The first row is the preflight: a server dying on it is an outage charged to that row, not a failed
    preflight (which would stop every run and every resume on that row)."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [POISON, *rows(20)])
    fake = config_for(hf_tokenizer, vocab_size=len(hf_tokenizer) - 1, latency_s=0.02)
    stop = threading.Event()
    with FakeSGLangServer(fake) as server:
        supervisor = _supervise(server, stop)
        try:
            result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
        finally:
            stop.set()
            supervisor.join(5)
    assert result.exit_code == 3, result.output
    failures = [orjson.loads(line) for line in (tmp_path / "out" / "failures.jsonl").read_bytes().splitlines()]
    assert [(f["id"], f["kind"]) for f in failures] == [("poison", "server_crash")]
    assert len(read_records(tmp_path / "out")) == 20
