"""One writer per output directory (review 2026-12 D1): DIR/.lock, held by run and resume for their whole life."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.store.lock import LOCK_NAME, DirectoryInUse, hold, is_locked
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config

_HOLDER = """
import sys, time
from pathlib import Path
from eagle_datagen.store.lock import hold
with hold(Path(sys.argv[1]), "eagle-datagen resume"):
    print("held", flush=True)
    time.sleep(60)
"""


def holder_process(directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def test_is_locked_names_the_live_holder_and_forgets_it_after_kill_9(tmp_path: Path) -> None:
    assert is_locked(tmp_path) is None  # no .lock at all
    process = holder_process(tmp_path)
    try:
        holder = is_locked(tmp_path)
        assert holder is not None and holder.pid == process.pid and holder.command == "eagle-datagen resume"
        assert f"in use by pid {holder}" == f"in use by pid {process.pid}"  # how verify's merge words it
        with pytest.raises(DirectoryInUse, match=rf"is in use by pid {process.pid} \(started 20"):
            hold(tmp_path, "eagle-datagen run").__enter__()
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate()
    assert (tmp_path / LOCK_NAME).exists()  # the file stays, but a dead holder holds nothing
    assert is_locked(tmp_path) is None
    with hold(tmp_path, "eagle-datagen run"):
        holder = is_locked(tmp_path)  # a reader in the same process sees it too
        assert holder is not None and holder.pid == os.getpid()
    assert is_locked(tmp_path) is None


def test_the_lock_needs_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"), hold(tmp_path / "nope", "eagle-datagen resume"):
        pass
    assert not (tmp_path / "nope").exists()


def test_resume_and_run_are_refused_while_another_process_writes(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    config = FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        latency_s=0.1,
        family=family_config(hf_tokenizer),
    )
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(60))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with FakeSGLangServer(config) as server:
        first = subprocess.Popen(
            [sys.executable, "-m", "eagle_datagen", "run", "--prompts", str(prompts), "--tokenizer",
             str(tiny_tokenizer), "--server-url", server.url, "--out", str(out), "--no-progress",
             "--concurrency", "4", "--shard-size", "7", "--max-new-tokens", "16"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not list((out / "shards").glob("*.partial")):
            assert time.monotonic() < deadline and first.poll() is None, "the first run did not start writing"
            time.sleep(0.05)
        resumed = CliRunner().invoke(main, ["resume", "--out", str(out), "--no-progress"], catch_exceptions=False)
        again = CliRunner().invoke(
            main,
            ["run", "--prompts", str(prompts), "--tokenizer", str(tiny_tokenizer), "--server-url", server.url,
             "--out", str(out), "--no-progress"],
            catch_exceptions=False,
        )  # fmt: skip
        assert first.poll() is None, "refused at once, while the first run still writes"
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    for result in (resumed, again):
        assert result.exit_code == 2, result.output
        assert f"{out} is in use by pid {first.pid} (started 20" in result.output
        assert f"kill -INT {first.pid}" in result.output and f"eagle-datagen resume --out {out}" in result.output
    ids = [r["id"] for r in read_records(out)]
    assert len(ids) == len(set(ids)) == 60
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert [run["command"] for run in manifest["runs"]] == ["run"]  # the refused ones left no trace


def test_run_into_a_directory_holding_only_a_stale_lock(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text('{"pid": 1, "command": "eagle-datagen run"}')  # killed before its manifest
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(3))
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--tokenizer", str(tiny_tokenizer), "--server-url", fake_server.url,
         "--out", str(out), "--no-progress"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(read_records(out)) == 3
