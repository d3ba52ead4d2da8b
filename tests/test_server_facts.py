"""Only the right model's outputs: every server passes the same facts check, at the start and after it comes back.

Regression tests for review D3 (a second server, or a server swapped during an outage, serving another model
was used without a word) and the server side of D4 (``--preferred-sampling-params`` that cut or stretch
outputs were not looked at).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import ServerError
from eagle_datagen.server.facts import FactsCheck, ServerFacts
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, expected_output, family_config

SAMPLING = {"max_new_tokens": 32, "temperature": 0.0}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_args(prompts: Path, out: Path, tokenizer: Path, *urls: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
            *(f"--server-url={u}" for u in urls), "--no-progress", "--max-new-tokens", "32"]  # fmt: skip


def config_for(hf_tokenizer: Any, **changes: Any) -> FakeConfig:
    base = {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id, "max_running_requests": 16,
            "model_path": "/models/tok", "family": family_config(hf_tokenizer)}  # fmt: skip
    return FakeConfig(**{**base, **changes})


def facts(url: str = "http://a", **changes: Any) -> ServerFacts:
    base: dict[str, Any] = dict(version="0.5.23", model_path="/models/m", reasoning_parser=None,
                                max_req_input_len=4096, max_running_requests=8, weight_version="default")  # fmt: skip
    return ServerFacts(url=url, **{**base, **changes})


def test_a_second_server_with_another_model_is_refused_before_any_request(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """D3 (a): only the first --server-url used to be compared; 99 of 200 records came from the other model."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(20))
    other = config_for(hf_tokenizer, model_path="/models/some-other-model")
    with FakeSGLangServer(config_for(hf_tokenizer)) as a, FakeSGLangServer(other) as b:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, a.url, b.url))
        sent = a.stats()["generate_received"] + b.stats()["generate_received"]
    assert result.exit_code == 1, result.output
    assert f"{b.url} is refused: model_path is '/models/some-other-model', not '/models/tok' as on {a.url}" in (
        result.output
    )
    assert "give --server-url only for those" in result.output
    assert sent == 0 and read_records(tmp_path / "out") == []


def test_a_server_whose_model_has_another_vocabulary_is_refused(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    """The served model's config.json (when the model is on this machine) must have the tokenizer model's vocab."""
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer / name).write_bytes((tiny_tokenizer / name).read_bytes())
    (tokenizer / "config.json").write_text(json.dumps({"vocab_size": len(hf_tokenizer)}))
    served = tmp_path / "served-model"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"vocab_size": 100_000}))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(4))
    with FakeSGLangServer(config_for(hf_tokenizer, model_path=str(served))) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tokenizer, server.url))
    assert result.exit_code == 1, result.output
    assert f"has vocab_size 100000, the tokenizer's model {len(hf_tokenizer)}: it is another model" in result.output


@pytest.mark.parametrize(
    ("preferred", "refused"),
    [
        ({"stop": ["\n\nUser:"]}, "stop"),
        ({"ignore_eos": True, "temperature": 0.7}, "ignore_eos"),
        ({"min_new_tokens": 8}, "min_new_tokens"),
        ({"json_schema": "{}"}, "json_schema"),
    ],
)
def test_preferred_sampling_params_that_change_outputs_are_refused(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, preferred: dict[str, Any], refused: str
) -> None:
    """D4: SGLang merges --preferred-sampling-params into every request; a stop there cut outputs at text."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(4))
    with FakeSGLangServer(config_for(hf_tokenizer, preferred_sampling_params=preferred)) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
        sent = server.stats()["generate_received"]
    assert result.exit_code == 1, result.output
    assert f"its --preferred-sampling-params set {refused} (" in result.output
    assert sent == 0


def test_harmless_preferred_sampling_params_pass_and_are_recorded(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(4))
    with FakeSGLangServer(config_for(hf_tokenizer, preferred_sampling_params={"top_k": 20})) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["server"]["facts"][0]["preferred_sampling_params"] == {"top_k": 20}


def _swap_during_outage(server: FakeSGLangServer, after: int, down_s: float, **changes: Any) -> threading.Thread:
    """Once ``server`` has answered ``after`` requests, it dies and comes back ``down_s`` later on the same port
    serving something else."""

    def swap() -> None:
        deadline = time.monotonic() + 60
        while server.stats()["generate_responses"] < after and time.monotonic() < deadline:
            time.sleep(0.01)
        server.go_down()
        server.update_config(**changes)
        time.sleep(down_s)
        server.come_up()

    thread = threading.Thread(target=swap)
    thread.start()
    return thread


@pytest.mark.parametrize("servers", [1, 2])
def test_a_server_that_comes_back_changed_is_never_used_again(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, servers: int, caplog: pytest.LogCaptureFixture
) -> None:
    """D3 (b): /server_info and /model_info were never read again after an outage; 20 records came from the other
    model. Now the server that came back changed stays out: with another server the run finishes there, alone
    it stops; either way no record is from the other model."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(1000))
    original = config_for(hf_tokenizer, latency_s=0.1)
    with FakeSGLangServer(original) as a, FakeSGLangServer(config_for(hf_tokenizer, latency_s=0.1)) as b:
        swapped = b if servers == 2 else a
        timer = _swap_during_outage(
            swapped, 100, 0.5, model_path="/models/some-other-model", reasoning_parser="deepseek-r1", seed=99
        )
        urls = (a.url, b.url) if servers == 2 else (a.url,)
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, *urls))
        timer.join()
    said = result.output + caplog.text  # the pool logs the server it leaves out; the last one stops the run
    assert f"{swapped.url} came back changed, so it is left out of the pool and never used again" in said
    assert "model_path is '/models/some-other-model', not '/models/tok' as at the start of the run" in said
    assert "it runs with --reasoning-parser deepseek-r1" in said
    records = read_records(tmp_path / "out")
    assert records, "the run wrote nothing before the swap"
    for record in records:
        assert record["output_ids"] == expected_output(original, record["prompt_ids"], SAMPLING)
    if servers == 2:
        assert result.exit_code == 0, result.output
        assert len(records) == 1000
    else:
        assert result.exit_code == 1, result.output
        assert len(records) < 1000


def test_one_check_at_start_and_at_recovery() -> None:
    check = FactsCheck(allow_reasoning_parser=False, model_vocab=None)
    check.start([facts("http://a", max_req_input_len=4096), facts("http://b", max_req_input_len=2048)])
    assert check.max_input_len == 2048  # servers may differ in memory; prompts were admitted under the smaller
    check.check(facts("http://a", max_req_input_len=4096))
    with pytest.raises(ServerError, match="max_req_input_len is 1000, below the 2048 the prompts were admitted under"):
        check.check(facts("http://b", max_req_input_len=1000))
    with pytest.raises(ServerError, match="weight_version is 'v2', not 'default' as at the start of the run"):
        check.check(facts("http://b", weight_version="v2"))
    with pytest.raises(ServerError, match="it runs with --reasoning-parser qwen3"):
        check.check(facts("http://b", reasoning_parser="qwen3"))
    with pytest.raises(ServerError, match=r"preferred_sampling_params is \{'top_k': 5\}, not None"):
        check.check(facts("http://b", preferred_sampling_params={"top_k": 5}))


def test_a_resume_against_another_model_warns(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> None:
    """The records already written and the new ones would come from two models: say so (a moved model is fine)."""
    rows = [{"id": f"s{i}", "prompt": f"q {i}"} for i in range(4)] + [
        {"id": f"l{i}", "prompt": "x" * 1500 + str(i)} for i in range(4)
    ]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out"
    with FakeSGLangServer(config_for(hf_tokenizer, context_length=1000)) as a:  # the long rows fail (400)
        first = invoke(*run_args(prompts, out, tiny_tokenizer, a.url))
    assert first.exit_code == 3, first.output
    with FakeSGLangServer(config_for(hf_tokenizer, model_path="/models/other")) as b:
        resumed = invoke("resume", "--out", str(out), "--server-url", b.url, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert "does not serve the model the records already written came from" in resumed.output
    assert "model_path '/models/tok' then, '/models/other' now" in resumed.output
