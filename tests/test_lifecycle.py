"""How a run ends: no silent hang, advice that works as printed, honest exit codes, render workers.

One regression test per defect of the 2026-12 review (D5, D8, D10, D11, D12, D16, D17, D20, D21);
each failed on the code before the fix.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import BadInputError
from eagle_datagen.inputs.prompts import SKIP_FIX, PromptRow
from eagle_datagen.inputs.render import Renderer, RenderPool, load_tokenizer
from eagle_datagen.store import logs
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_args(prompts: Path, out: Path, tokenizer: Path, url: str, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
            "--server-url", url, "--no-progress", "--max-new-tokens", "32", *extra]  # fmt: skip


def config(hf_tokenizer: Any, **changes: Any) -> FakeConfig:
    values = {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id, "max_running_requests": 32,
              "family": family_config(hf_tokenizer)}  # fmt: skip
    return FakeConfig(**{**values, **changes})


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "prompt": f"question number {i}: what is {i} plus {i}?"} for i in range(n)]


def advised(output: str, pattern: str) -> list[str]:
    """The command the tool printed (matching ``pattern``), as arguments for the CLI."""
    match = re.search(pattern, output)
    assert match, f"no advice matching {pattern!r} in:\n{output}"
    words = shlex.split(match.group(1))
    assert words[0] == "eagle-datagen"
    return words[1:]


# --- D5, D12 (issue 16 item 7): no silent hangs ---------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_write_error_on_failures_jsonl_stops_the_run_with_exit_1(
    tmp_path: Path,
    tiny_tokenizer: Path,
    hf_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D5: the failure log's append failing (EFBIG, ENOSPC) used to kill its worker silently: the run hung."""
    real_write = os.write
    calls = {"n": 0}

    def write(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.EFBIG, "File too large")
        return real_write(fd, data)

    monkeypatch.setattr(logs.os, "write", write)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(200))
    with FakeSGLangServer(config(hf_tokenizer, context_length=40, max_running_requests=4)) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--no-preflight"))
        assert server.stats()["in_flight"] == 0
        assert result.exit_code == 1, result.output
        assert "cannot write" in result.output and "failures.jsonl: File too large" in result.output
        gc.collect()  # a request task whose exception nobody looked at would be reported now
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
        monkeypatch.undo()  # space is free again, and the server takes these prompts: the printed command continues
        server.update_config(context_length=8192)
        resumed = invoke(*advised(result.output, r"Continue with:\n  (.+)"))
    assert resumed.exit_code == 0, resumed.output
    assert len(read_records(tmp_path / "out")) == 200


@pytest.mark.timeout(90)
def test_an_exception_in_the_monitor_stops_the_run(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D5: an exception in the monitor ended stall detection for the rest of the run, without a word."""

    async def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the health probe broke")

    monkeypatch.setattr("eagle_datagen.generate.pipeline.is_healthy", broken)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(40))
    with FakeSGLangServer(config(hf_tokenizer, stall_after=10, stall_s=4.0)) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--stall-timeout-s", "1",
                                  "--checkpoint-interval-s", "0.2"))  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "RuntimeError: the health probe broke" in result.output
    assert "Traceback" not in result.output
    assert f"Continue with:\n  eagle-datagen resume --out {tmp_path / 'out'}" in result.output


def _start_cli(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "eagle_datagen", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_sigint_during_the_preflight_honours_the_grace_period(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """D12: the first Ctrl-C waited for the preflight request (up to --request-timeout-s), not --grace-period-s."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(5))
    out = tmp_path / "out"
    with FakeSGLangServer(config(hf_tokenizer, latency_s=120.0)) as server:
        process = _start_cli(run_args(prompts, out, tiny_tokenizer, server.url, "--grace-period-s", "1"))
        try:
            deadline = time.monotonic() + 60
            while server.stats()["generate_received"] < 1:  # the preflight is in flight
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=60)  # far below the fake's 120 s
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 130, stderr
    assert "SIGINT: stopping" in stderr and f"eagle-datagen resume --out {out}" in stderr


# --- D8 (item 6): bad rows never cost in-flight work, and the advice leads somewhere --------------------------


def test_a_bad_row_late_in_the_file_is_found_before_any_request_and_the_advice_works(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    """D8a: the bad row was found after 160 requests were sent, and the advice ('fix the row') led nowhere."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [*rows(300), {"id": "last", "messages": [{"role": "robot"}]}])
    out = tmp_path / "out"
    args = run_args(prompts, out, tiny_tokenizer, fake_server.url)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert f"{prompts}:301: messages[0] has role 'robot'" in result.output
    assert "fix the row, or pass --skip-bad-lines" in result.output
    assert fake_server.stats()["generate_received"] == 0
    # Nothing was written, so `resume` has nothing to continue, and says what to do instead.
    resumed = invoke("resume", "--out", str(out))
    assert resumed.exit_code == 2 and f"start it with `eagle-datagen run` and --out {out}" in resumed.output
    # Both pieces of advice, as written: the same command with --skip-bad-lines, or with the row fixed.
    skipped = invoke(*args, "--skip-bad-lines", "--out", str(tmp_path / "skipped"))
    assert skipped.exit_code == 0, skipped.output
    assert len(read_records(tmp_path / "skipped")) == 300
    prompts.write_bytes(prompts.read_bytes().replace(b'"robot"', b'"user","content":"hi"'))
    fixed = invoke(*args)
    assert fixed.exit_code == 0, fixed.output
    assert len(read_records(out)) == 301


def test_a_row_the_template_rejects_mid_run_drains_the_requests_in_flight_and_resume_skips_it(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D8a: a bad row found while requests were in flight cancelled them (generated, then thrown away)."""
    real = Renderer.render_many

    def render_many(self: Renderer, rows: Any, path: str = "<prompts>") -> list[Any]:
        results = real(self, rows, path)
        return [
            BadInputError(path, row.line, "template_error", "the chat template raised: boom", SKIP_FIX)
            if row.key == "bad"
            else result
            for row, result in zip(rows, results, strict=True)
        ]

    monkeypatch.setattr(Renderer, "render_many", render_many)
    all_rows = rows(200)
    all_rows.insert(100, {"id": "bad", "prompt": "the template raises on this one"})
    prompts = write_jsonl(tmp_path / "prompts.jsonl", all_rows)
    out = tmp_path / "out"
    with FakeSGLangServer(config(hf_tokenizer, latency_s=0.3)) as server:
        result = invoke(*run_args(prompts, out, tiny_tokenizer, server.url, "--concurrency", "8"))
        sent = server.stats()["generate_received"] - 1  # less the preflight
        assert result.exit_code == 2, result.output
        assert f"{prompts}:101: the chat template raised: boom" in result.output
        assert sent > 8 and len(read_records(out)) == sent  # every request sent became a record
        again = advised(result.output, r"continue: (eagle-datagen resume --out \S+ --skip-bad-lines)")
        resumed = invoke(*again, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert sorted(r["id"] for r in read_records(out)) == sorted(r["id"] for r in rows(200))
    (reject,) = [orjson.loads(line) for line in (out / "rejects.jsonl").read_bytes().splitlines()]
    assert reject["line"] == 101 and reject["kind"] == "template_error"


def test_after_a_failed_preflight_the_printed_command_continues(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    """D8b: the preflight said 'then run again', which `run` refuses (the directory is not empty)."""
    fake_server.update_config(leak_prompt_tail=1.0)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(20))
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server.url))
    assert result.exit_code == 1, result.output
    assert "preflight request" in result.output and "run again" not in result.output
    fake_server.update_config(leak_prompt_tail=0.0)
    resumed = invoke(*advised(result.output, r"Continue with:\n  (.+)"))
    assert resumed.exit_code == 0, resumed.output
    assert len(read_records(out)) == 20


# --- D16, D17, D21 (item 10): honest endings and settings ----------------------------------------------------


def test_a_run_in_which_requests_failed_exits_3_and_says_how_many_and_where(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """D16: a run in which every request failed exited 0."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(20))
    out = tmp_path / "out"
    with FakeSGLangServer(config(hf_tokenizer, context_length=40)) as server:
        result = invoke(*run_args(prompts, out, tiny_tokenizer, server.url, "--no-preflight"))
        assert result.exit_code == 3, result.output
        assert f"finished with 20 failed record(s) (http_400 20): see {out / 'failures.jsonl'}" in result.output
        server.update_config(context_length=8192)  # the cause is fixed: the printed command sends them again
        again = invoke(*advised(result.output, r"; (eagle-datagen resume --out \S+) sends them again"))
    assert again.exit_code == 0, again.output
    assert len(read_records(out)) == 20


def test_a_complete_run_resumes_without_any_server(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    """D17: a resume with nothing left to do still needed a live server (in managed mode: a model load)."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(20))
    out = tmp_path / "out"
    with FakeSGLangServer(config(hf_tokenizer)) as server:
        assert invoke(*run_args(prompts, out, tiny_tokenizer, server.url)).exit_code == 0
    result = invoke("resume", "--out", str(out), "--no-progress")  # the server is gone
    assert result.exit_code == 0, result.output
    assert "nothing to do: all 20 records are in" in result.output


@pytest.mark.timeout(180)
def test_resume_with_model_launches_instead_of_the_saved_server_url(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D17: `resume --model M` after a --server-url run ignored --model and failed on the old URL."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(20))
    out = tmp_path / "out"
    with FakeSGLangServer(config(hf_tokenizer, drop_stop_token=1.0)) as server:
        first = invoke(*run_args(prompts, out, tiny_tokenizer, server.url, "--no-preflight"))
    assert first.exit_code == 3, first.output  # every record failed a check: resume sends them again
    model = Path(shutil.copytree(tiny_tokenizer, tmp_path / "model"))
    fake = {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id, "max_running_requests": 16,
            "family": family_config(hf_tokenizer)}  # fmt: skip
    # the stand-in imports this checkout's package, not whatever the venv has installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), str(STANDIN.parents[1] / "src")]))
    monkeypatch.setenv("FAKE_SGLANG_CONFIG_JSON", orjson.dumps(fake).decode())
    result = invoke("resume", "--out", str(out), "--model", str(model), "--server-python", sys.executable,
                    "--tp-size", "1", "--startup-timeout-s", "60", "--no-progress")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--model given: it replaces the saved --server-url" in result.output
    assert "starting SGLang" in result.output
    assert len(read_records(out)) == 20
    saved = orjson.loads((out / "manifest.json").read_bytes())["server"]["options"]
    assert "server_url" not in saved and saved["model"] == str(model)


def test_several_samples_with_greedy_sampling_warn(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    """D21: --samples-per-prompt 4 with greedy sampling sent 4 identical requests per prompt without a word."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(3))
    greedy = invoke(
        *run_args(prompts, tmp_path / "greedy", tiny_tokenizer, fake_server.url, "--samples-per-prompt", "4")
    )
    assert greedy.exit_code == 0, greedy.output
    assert "warning: --samples-per-prompt 4 with greedy sampling (the run's)" in greedy.output
    sampled = invoke(*run_args(prompts, tmp_path / "sampled", tiny_tokenizer, fake_server.url,
                               "--samples-per-prompt", "4", "--temperature", "0.7"))  # fmt: skip
    assert sampled.exit_code == 0, sampled.output
    assert "greedy sampling" not in sampled.output
    mixed = invoke(*run_args(prompts, tmp_path / "mixed", tiny_tokenizer, fake_server.url, "--samples-per-prompt", "4",
                             "--mix-entry", 'hot:1:{"sampling": {"temperature": 0.7}}', "--mix-entry", "cold:1:{}"))  # fmt: skip
    assert mixed.exit_code == 0, mixed.output
    assert "with greedy sampling (mix variant(s) cold)" in mixed.output


# --- D10, D11, D20 (items 6, 11): Python version, render workers ---------------------------------------------


def test_requires_python_is_what_ci_tests() -> None:
    """D10: 3.10 was declared but broke on import (tomli) and in the stop path (asyncio.TimeoutError)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert project["tool"]["mypy"]["python_version"] == "3.11"
    assert "tomli" not in (ROOT / "src" / "eagle_datagen" / "options.py").read_text()


def _rows(n: int) -> list[PromptRow]:
    return [
        PromptRow(key=f"k{i}", line=i + 1, messages=[{"role": "user", "content": f"question {i}"}]) for i in range(n)
    ]


def _ready(pool: RenderPool) -> None:
    deadline = time.monotonic() + 120
    while not pool.ready():
        assert time.monotonic() < deadline, "the render workers did not start"
        time.sleep(0.05)


def _workers(pool: RenderPool) -> list[int]:
    return list(pool._executor._processes) if pool._executor is not None else []  # type: ignore[attr-defined]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text():
            time.sleep(0.01)


@pytest.mark.parametrize("replacements", [3, 0])
def test_a_dead_render_worker_is_replaced_and_no_chunk_is_lost(
    tiny_tokenizer: Path, caplog: pytest.LogCaptureFixture, replacements: int
) -> None:
    """D11: a render worker killed (OOM killer) ended the run with a BrokenProcessPool traceback."""
    renderer = Renderer(load_tokenizer(tiny_tokenizer))
    chunks = [_rows(200)[i : i + 10] for i in range(0, 200, 10)]
    expected = [renderer.render_many(chunk) for chunk in chunks]
    caplog.set_level(logging.WARNING, logger="eagle_datagen")
    with RenderPool(renderer, tiny_tokenizer, workers=1, ahead=4, max_replacements=replacements) as pool:
        _ready(pool)

        def feed() -> Any:
            for i, chunk in enumerate(chunks):
                if i == 6:
                    _kill(_workers(pool))
                yield chunk

        got = list(pool.render_chunks(feed()))
        assert got == expected
        assert pool.replacements == 1 and pool.in_process == (replacements == 0)
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "a render worker died" in warning.getMessage() and "\n" not in warning.getMessage()
    assert warning.exc_info is None


def test_render_workers_ignore_sigint(tiny_tokenizer: Path) -> None:
    """D20: Ctrl-C reached the render workers too, which died printing KeyboardInterrupt tracebacks."""
    renderer = Renderer(load_tokenizer(tiny_tokenizer))
    chunk = _rows(10)
    with RenderPool(renderer, tiny_tokenizer, workers=1) as pool:
        _ready(pool)
        (pid,) = _workers(pool)
        os.kill(pid, signal.SIGINT)  # what the terminal sends the whole foreground process group
        assert list(pool.render_chunks([chunk, chunk])) == [renderer.render_many(chunk)] * 2
        assert _workers(pool) == [pid] and pool.replacements == 0
