"""Checkpoint and resume: kill -9 at random moments, torn tails, refused plan changes, Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.testing.fake_sglang import family_config


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def fake_process(tmp_path: Path, hf_tokenizer: Any) -> Iterator[tuple[str, Path]]:
    """A fake SGLang server in its own process, with latency, so kills land mid-flight."""
    port_file = tmp_path / "fake.port"
    config = {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id, "latency_s": 0.05,
              "max_running_requests": 4, "family": family_config(hf_tokenizer)}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "eagle_datagen.testing.fake_sglang", "--port", "0", "--port-file", str(port_file),
         "--config-json", orjson.dumps(config).decode()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not (port_file.exists() and port_file.read_text().strip()):
        assert time.monotonic() < deadline and process.poll() is None, "the fake server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port_file.read_text().strip()}", port_file
    finally:
        process.terminate()
        process.wait(timeout=10)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle_datagen", *args]


def assert_lines_parse(out: Path) -> None:
    for path in (out / "shards").glob("shard_*.jsonl*"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n") or path.name.endswith(".partial")
        for line in data.splitlines()[:-1] if path.name.endswith(".partial") else data.splitlines():
            orjson.loads(line)


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_and_doubles_nothing(
    tmp_path: Path, tiny_tokenizer: Path, fake_process: tuple[str, Path]
) -> None:
    url, _ = fake_process
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(600))
    # Default checkpoints (1000 records / 10 s): they bound only what an OS crash can take, not a kill -9.
    concurrency = 2
    common = ["--server-url", url, "--no-progress", "--concurrency", str(concurrency)]
    plan = [
        "--prompts",
        str(prompts),
        "--tokenizer",
        str(tiny_tokenizer),
        "--max-new-tokens",
        "40",
        "--shard-size",
        "37",
    ]

    reference = tmp_path / "reference"
    result = invoke("run", *plan, "--out", str(reference), *common)
    assert result.exit_code == 0, result.output
    expected = {r["id"]: r for r in read_records(reference)}
    assert len(expected) == 600

    out = tmp_path / "out"
    rng = random.Random(1234)
    kills = 0
    first = cli("run", *plan, "--out", str(out), *common)
    command = first
    finished = False
    progress: list[int] = [0]  # records on disk after each kill: kills must land mid-run
    sent = fake_responses(url)
    while kills < 12 and not finished:
        received = fake_stats(url)["generate_received"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120  # start-up takes 1.5 s, or much more on a loaded machine
        while fake_stats(url)["generate_received"] < received + 2 and process.poll() is None:
            assert time.monotonic() < deadline, "the run sent nothing"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))  # the kill lands mid-run, at a random moment
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        _, stderr = process.communicate()
        if process.returncode != -signal.SIGKILL:
            assert process.returncode == 0, stderr.decode()
            finished = True
        assert_lines_parse(out)
        done = [r["id"] for r in read_records_tolerant(out)]
        assert len(done) == len(set(done)), "an id was written twice"
        # Every response the fake finished sending is on disk, but for the requests in flight at the kill
        # (at most --concurrency) and the process's preflight, whose output is never a record.
        sent_before, sent = sent, fake_responses(url)
        lost = (sent - sent_before) - (len(done) - progress[-1])
        assert lost <= concurrency + 1, f"{lost} finished responses lost to kill -9 #{kills}"
        progress.append(len(done))
        # Killed before its manifest (a slow start-up): `run` again, as its refusal of a used --out allows.
        command = cli("resume", "--out", str(out)) if (out / "manifest.json").exists() else first
    assert kills >= 10, f"only {kills} kills landed before the run finished"

    final = subprocess.run(cli("resume", "--out", str(out)), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 600
    assert set(ids) == set(expected)
    for record in records:
        assert record == expected[record["id"]]
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert sum(s["records"] for s in manifest["shards"]) == 600  # the last, short shard is finalized too
    assert sum(1 for a, b in itertools.pairwise(progress) if b > a) >= 5, progress


def fake_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/fake/stats", timeout=10) as reply:
        stats: dict[str, Any] = orjson.loads(reply.read())
    return stats


def fake_responses(url: str) -> int:
    """Responses the fake SGLang has finished sending, once nothing is in flight there any more."""
    deadline = time.monotonic() + 30
    while True:
        stats = fake_stats(url)
        if stats["in_flight"] == 0 or time.monotonic() > deadline:
            return int(stats["generate_responses"])
        time.sleep(0.05)


def read_records_tolerant(out: Path) -> list[dict[str, Any]]:
    """Records of a directory a kill may have left with a torn last line."""
    records = []
    for path in sorted((out / "shards").glob("shard_*.jsonl*")):
        for line in path.read_bytes().split(b"\n"):
            with contextlib.suppress(orjson.JSONDecodeError):
                records.append(orjson.loads(line))
    return records


def small_run(tmp_path: Path, tokenizer: Path, url: str, n: int = 20, *extra: str, code: int = 0) -> tuple[Path, Path]:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(n))
    out = tmp_path / "out"
    result = invoke("run", "--prompts", str(prompts), "--tokenizer", str(tokenizer), "--server-url", url,
                    "--out", str(out), "--no-progress", "--shard-size", "7", *extra)  # fmt: skip
    assert result.exit_code == code, result.output
    return prompts, out


def test_torn_tail_is_repaired_and_resent(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    _, out = small_run(tmp_path, tiny_tokenizer, fake_server.url)
    # Turn the last shard back into what a kill mid-write leaves: a .partial with a torn last line.
    manifest_path = out / "manifest.json"
    manifest = orjson.loads(manifest_path.read_bytes())
    last = manifest["shards"].pop()
    manifest_path.write_bytes(orjson.dumps(manifest))
    final = out / "shards" / last["name"]
    final.with_suffix(".ids").unlink()
    lines = final.read_bytes().splitlines(keepends=True)
    torn_id = orjson.loads(lines[-1])["id"]
    partial = final.with_name(final.name + ".partial")
    partial.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])
    final.unlink()
    result = invoke("resume", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "repaired a torn tail" in result.output
    records = read_records(out)
    assert [r["id"] for r in records].count(torn_id) == 1 and len(records) == 20
    assert not list((out / "shards").glob("*.partial"))


def test_resume_of_a_finished_run_sends_nothing(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    _, out = small_run(tmp_path, tiny_tokenizer, fake_server.url)
    before = fake_server.stats()["generate_received"]
    result = invoke("resume", "--out", str(out), "--no-preflight")
    assert result.exit_code == 0, result.output
    assert fake_server.stats()["generate_received"] == before
    assert "nothing to do: all 20 records are in" in result.output


def test_resume_refuses_a_changed_prompts_file(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts, out = small_run(tmp_path, tiny_tokenizer, fake_server.url)
    with prompts.open("ab") as handle:
        handle.write(b'{"prompt": "one more"}\n')
    result = invoke("resume", "--out", str(out))
    assert result.exit_code == 2
    assert "prompts.sha256" in result.output and "prompts.size" in result.output


def test_resume_refuses_another_tokenizer_or_template(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    _, out = small_run(tmp_path, tiny_tokenizer, fake_server.url)
    other = tmp_path / "tok2"
    shutil.copytree(tiny_tokenizer, other)
    config = other / "tokenizer_config.json"
    config.write_text(config.read_text().replace("assistant<|im_middle|>", "assistant <|im_middle|>"))
    result = invoke("resume", "--out", str(out), "--tokenizer", str(other))
    assert result.exit_code == 2
    assert "tokenizer.fingerprint" in result.output and "tokenizer.chat_template_sha256" in result.output


def test_resume_refuses_changed_sampling_defaults(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_tokenizer, model)
    (model / "generation_config.json").write_text('{"temperature": 0.7}')
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(5))
    out = tmp_path / "out"
    result = invoke("run", "--prompts", str(prompts), "--tokenizer", str(model), "--server-url", fake_server.url,
                    "--out", str(out), "--no-progress")  # fmt: skip
    assert result.exit_code == 0, result.output
    (model / "generation_config.json").write_text('{"temperature": 0.9}')
    result = invoke("resume", "--out", str(out))
    assert result.exit_code == 2
    assert "sampling_params.temperature: pinned 0.7, now 0.9" in result.output


def test_resume_may_change_server_and_speed_options(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    from eagle_datagen.testing.fake_sglang import FakeSGLangServer

    _, out = small_run(tmp_path, tiny_tokenizer, fake_server.url, 20, "--max-new-tokens", "8")
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    last = manifest["shards"].pop()  # lose the last shard: resume must redo exactly its records
    (out / "manifest.json").write_bytes(orjson.dumps(manifest))
    (out / "shards" / last["name"]).unlink()
    (out / "shards" / last["name"]).with_suffix(".ids").unlink()
    with FakeSGLangServer(fake_server.config) as other:
        result = invoke("resume", "--out", str(out), "--server-url", other.url, "--concurrency", "3")
    assert result.exit_code == 0, result.output
    assert len(read_records(out)) == 20
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["runs"][-1]["servers"] == [other.url]


def test_failed_rows_are_retried_unless_kept_aside(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    fake_server.update_config(drop_stop_token=1.0)
    _, out = small_run(tmp_path, tiny_tokenizer, fake_server.url, 6, "--no-preflight", code=3)
    assert read_records(out) == []
    fake_server.update_config(drop_stop_token=0.0)
    kept = invoke("resume", "--out", str(out), "--no-retry-failed")
    assert kept.exit_code == 3 and read_records(out) == []
    assert "finished with 6 failed record(s) (check_stop_token 6)" in kept.output
    retried = invoke("resume", "--out", str(out))
    assert retried.exit_code == 0, retried.output
    assert len(read_records(out)) == 6


def test_run_into_a_used_directory_points_to_resume(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts, out = small_run(tmp_path, tiny_tokenizer, fake_server.url)
    result = invoke("run", "--prompts", str(prompts), "--tokenizer", str(tiny_tokenizer), "--server-url",
                    fake_server.url, "--out", str(out))  # fmt: skip
    assert result.exit_code == 2 and "eagle-datagen resume --out" in result.output


@pytest.mark.slow
def test_sigint_stops_cleanly_and_prints_the_resume_command(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer

    config = FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        latency_s=0.4,
        family=family_config(hf_tokenizer),
    )
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(200))
    out = tmp_path / "out"
    with FakeSGLangServer(config) as server:
        process = subprocess.Popen(
            cli("run", "--prompts", str(prompts), "--tokenizer", str(tiny_tokenizer), "--server-url", server.url,
                "--out", str(out), "--no-progress", "--concurrency", "8"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while server.stats()["generate_responses"] < 10:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        assert "SIGINT: stopping" in stderr
        assert f"eagle-datagen resume --out {out}" in stderr
        partial_count = len(read_records(out))
        assert 0 < partial_count < 200
        assert server.stats()["in_flight"] == 0  # requests in flight were waited for, not abandoned
        result = invoke("resume", "--out", str(out))
        assert result.exit_code == 0, result.output
    assert len(read_records(out)) == 200


def test_environment_is_clean() -> None:
    assert "EAGLE_DATAGEN_API_KEY" not in os.environ


def test_sigterm_then_sigkill_loses_no_response_received_before_the_signal(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """What Kubernetes does at the end of a grace period shorter than the run's (review 2026-12 D2, r25)."""
    from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer

    config = FakeConfig(vocab_size=len(hf_tokenizer), eos_id=hf_tokenizer.eos_token_id, latency_s=0.02,
                        max_running_requests=8, family=family_config(hf_tokenizer))  # fmt: skip
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(2000))
    out = tmp_path / "out"
    with FakeSGLangServer(config) as server:
        process = subprocess.Popen(
            cli("run", "--prompts", str(prompts), "--tokenizer", str(tiny_tokenizer), "--server-url", server.url,
                "--out", str(out), "--no-progress", "--concurrency", "8", "--max-new-tokens", "16"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while server.stats()["generate_responses"] < 100:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
        server.update_config(latency_s=60.0)  # from now on, what is sent stays in flight
        time.sleep(0.5)
        received = server.stats()["generate_responses"] - 1  # minus the preflight
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # well inside the 30 s grace period
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert len(read_records_tolerant(out)) >= received > 0


def test_the_first_stop_request_checkpoints_at_once() -> None:
    """Before the drain, not after it: a node going down during the grace period keeps what arrived."""
    asyncio.run(_first_stop_request_checkpoints())


async def _first_stop_request_checkpoints() -> None:  # request_stop runs on the loop (a signal handler)
    import types

    from eagle_datagen.errors import OutputWriteError
    from eagle_datagen.generate.pipeline import Pipeline, Stats

    calls: list[str] = []
    store = types.SimpleNamespace(checkpoint=lambda: calls.append("store"))
    failures = types.SimpleNamespace(checkpoint=lambda: calls.append("failures"))
    producer = types.SimpleNamespace(stop=types.SimpleNamespace(set=lambda: None))
    pipeline = Pipeline(
        producer=producer, pool=None, http=None, transport=None, request_timeout_s=1.0,  # type: ignore[arg-type]
        store=store, failures=failures, sampling_params={}, spec=None, concurrency=1,  # type: ignore[arg-type]
        max_retries=0, checkpoint_records=1000, checkpoint_interval_s=10.0, stall_timeout_s=60.0,
        preflight=False, stats=Stats(),
    )  # fmt: skip
    pipeline.request_stop()
    assert calls == ["store", "failures"]
    pipeline.request_stop()  # a later call (the run's own clean-up) does not fsync again
    assert calls == ["store", "failures"]

    def full() -> None:
        raise OutputWriteError("cannot write shard: the disk is full")

    broken = Pipeline(
        producer=producer, pool=None, http=None, transport=None, request_timeout_s=1.0,  # type: ignore[arg-type]
        store=types.SimpleNamespace(checkpoint=full), failures=failures, sampling_params={},  # type: ignore[arg-type]
        spec=None, concurrency=1, max_retries=0, checkpoint_records=1000, checkpoint_interval_s=10.0,
        stall_timeout_s=60.0, preflight=False, stats=Stats(),
    )  # fmt: skip
    broken.request_stop()  # from a signal handler: the error stops the run with its message, it is not lost
    assert isinstance(broken.fatal, OutputWriteError)
