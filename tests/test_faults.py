"""Reliability: 503s, dropped connections, restarts, outages, stalls, disk full, keys and bad arguments."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.store import shards
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_args(prompts: Path, out: Path, tokenizer: Path, url: str, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
            "--server-url", url, "--no-progress", "--max-new-tokens", "32", *extra]  # fmt: skip


def clean_config(hf_tokenizer: Any, **faults: Any) -> FakeConfig:
    return FakeConfig(vocab_size=len(hf_tokenizer), eos_id=hf_tokenizer.eos_token_id, max_running_requests=32,
                      family=family_config(hf_tokenizer), **faults)  # fmt: skip


def by_id(out: Path) -> dict[str, dict[str, Any]]:
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in records}


@pytest.mark.slow
def test_503s_drops_and_a_restart_lose_nothing(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(2000))
    with FakeSGLangServer(clean_config(hf_tokenizer)) as clean:
        result = invoke(*run_args(prompts, tmp_path / "clean", tiny_tokenizer, clean.url))
        assert result.exit_code == 0, result.output
    expected = by_id(tmp_path / "clean")
    assert len(expected) == 2000

    faulty = clean_config(hf_tokenizer, error_503_rate=0.10, drop_rate=0.03, seed=7, latency_s=0.002)
    with FakeSGLangServer(faulty) as server:
        timer = threading.Timer(1.0, server.restart_after, args=(1.5,))
        timer.start()
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--max-retries", "8"))
        timer.join()
        stats = server.stats()
    assert result.exit_code == 0, result.output
    assert stats["faults_503"] > 100 and stats["dropped"] > 30
    got = by_id(tmp_path / "out")
    assert got == expected
    assert not (tmp_path / "out" / "failures.jsonl").read_bytes()


def test_an_outage_pauses_dispatch_instead_of_burning_retries(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(300))
    with FakeSGLangServer(clean_config(hf_tokenizer, latency_s=0.01)) as server:

        def outage_mid_run() -> None:  # after the preflight and some records, however slow the start-up
            deadline = time.monotonic() + 120
            while server.stats()["generate_responses"] < 10 and time.monotonic() < deadline:
                time.sleep(0.005)
            server.restart_after(3.0)

        timer = threading.Thread(target=outage_mid_run)
        timer.start()
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--max-retries", "1"))
        timer.join()
    assert result.exit_code == 0, result.output
    assert len(by_id(tmp_path / "out")) == 300
    assert "requeued after a server went down" in result.output


def test_a_stalled_server_is_detected_and_its_requests_requeued(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(60))
    with FakeSGLangServer(clean_config(hf_tokenizer, stall_after=20, stall_s=4.0)) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--stall-timeout-s", "1"))
    assert result.exit_code == 0, result.output
    assert len(by_id(tmp_path / "out")) == 60


def test_4xx_other_than_auth_is_recorded_not_retried(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "x"}])
    with FakeSGLangServer(clean_config(hf_tokenizer, context_length=40)) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--no-preflight"))
        assert server.stats()["generate_received"] == 1
    assert result.exit_code == 3
    (failure,) = [orjson.loads(x) for x in (tmp_path / "out" / "failures.jsonl").read_bytes().splitlines()]
    assert failure["kind"] == "http_400"


def test_disk_full_stops_with_resume_advice_and_no_corrupt_shard(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(200))
    out = tmp_path / "out"
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            half = bytes(data)[: len(data) // 2]  # a partial write, then the disk is full
            real_write(fd, half)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(shards.os, "write", failing_write)
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server.url, "--checkpoint-records", "5"))
    monkeypatch.undo()
    assert result.exit_code == 1
    assert "the disk is full" in result.output and "eagle-datagen resume" in result.output
    for path in (out / "shards").glob("shard_*"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n")
        for line in data.splitlines():
            orjson.loads(line)
    before = len(read_records(out))
    assert before < 200
    result = invoke("resume", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert len(by_id(out)) == 200


def test_api_key_is_sent_but_never_logged_or_saved(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    secret = "sk-very-secret-123"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(10))
    with FakeSGLangServer(clean_config(hf_tokenizer, api_key=secret)) as server:
        denied = invoke(*run_args(prompts, tmp_path / "denied", tiny_tokenizer, server.url))
        assert denied.exit_code == 1 and "--api-key" in denied.output
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--api-key", secret))
        assert result.exit_code == 0, result.output
    assert secret not in result.output
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_api_key_from_the_environment(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE_DATAGEN_API_KEY", "env-key")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(3))
    with FakeSGLangServer(clean_config(hf_tokenizer, api_key="env-key")) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
    assert result.exit_code == 0, result.output


def test_a_reasoning_parser_on_the_server_is_refused(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(3))
    with FakeSGLangServer(clean_config(hf_tokenizer, reasoning_parser="kimi_k2")) as server:
        refused = invoke(*run_args(prompts, tmp_path / "a", tiny_tokenizer, server.url))
        allowed = invoke(*run_args(prompts, tmp_path / "b", tiny_tokenizer, server.url, "--allow-reasoning-parser"))
    assert refused.exit_code == 1 and "--reasoning-parser kimi_k2" in refused.output
    assert allowed.exit_code == 0, allowed.output


class TestBadArgumentsFailBeforeAnyServer:
    """Each is refused before any request (the fake server counts none)."""

    @pytest.fixture
    def prompts(self, tmp_path: Path) -> Path:
        return write_jsonl(tmp_path / "prompts.jsonl", varied_rows(3))

    def check(self, fake_server: Any, result: Any, code: int, *needles: str) -> None:
        assert result.exit_code == code, result.output
        for needle in needles:
            assert needle in result.output
        assert fake_server.stats()["generate_received"] == 0

    def test_missing_tokenizer(self, tmp_path: Path, prompts: Path, fake_server: Any) -> None:
        result = invoke(*run_args(prompts, tmp_path / "o", tmp_path / "nope", fake_server.url))
        self.check(fake_server, result, 2, "does not exist", "--tokenizer")

    def test_tokenizer_without_chat_template(
        self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any
    ) -> None:
        import shutil

        bare = tmp_path / "bare"
        shutil.copytree(tiny_tokenizer, bare)
        config = orjson.loads((bare / "tokenizer_config.json").read_bytes())
        config.pop("chat_template", None)
        (bare / "tokenizer_config.json").write_bytes(orjson.dumps(config))
        (bare / "chat_template.jinja").unlink(missing_ok=True)
        result = invoke(*run_args(prompts, tmp_path / "o", bare, fake_server.url))
        self.check(fake_server, result, 2, "has no chat template")

    def test_unparsable_chat_template_kwargs(
        self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any
    ) -> None:
        result = invoke(
            *run_args(prompts, tmp_path / "o", tiny_tokenizer, fake_server.url, "--chat-template-kwargs", "{thinking")
        )
        self.check(fake_server, result, 2, "--chat-template-kwargs must be a JSON object")

    @pytest.mark.parametrize("value", ["0", "-3"])
    def test_non_positive_concurrency(
        self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any, value: str
    ) -> None:
        result = CliRunner().invoke(
            main, run_args(prompts, tmp_path / "o", tiny_tokenizer, fake_server.url, "--concurrency", value)
        )
        self.check(fake_server, result, 2, "--concurrency")

    def test_out_is_a_file(self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
        target = tmp_path / "file"
        target.write_text("x")
        result = invoke(*run_args(prompts, target, tiny_tokenizer, fake_server.url))
        self.check(fake_server, result, 2, "is a file")

    @pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
    def test_out_not_writable(self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        result = invoke(*run_args(prompts, locked / "o", tiny_tokenizer, fake_server.url))
        self.check(fake_server, result, 2, "cannot create")

    def test_unknown_sampling_key(self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
        result = invoke(
            *run_args(prompts, tmp_path / "o", tiny_tokenizer, fake_server.url, "--sampling-params", '{"seed": 1}')
        )
        self.check(fake_server, result, 2, "'seed' is not accepted by SGLang")

    def test_refused_sampling_key(self, tmp_path: Path, prompts: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
        result = invoke(
            *run_args(
                prompts, tmp_path / "o", tiny_tokenizer, fake_server.url, "--sampling-params", '{"ignore_eos": true}'
            )
        )
        self.check(fake_server, result, 2, "never end in EOS")
