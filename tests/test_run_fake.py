"""``eagle-datagen run`` end to end against the fake SGLang server."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, served_tools, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.inputs.render import Renderer, load_tokenizer
from eagle_datagen.testing.fake_sglang import expected_output


def invoke(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result


def run_args(prompts: Path, out: Path, tokenizer: Path, server: Any, *extra: str) -> list[str]:
    return [
        "run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
        "--server-url", server.url, "--no-progress", *extra,
    ]  # fmt: skip


def test_1000_prompts_are_exact_and_each_key_appears_once(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(1000))
    out = tmp_path / "out"
    result = invoke(
        *run_args(prompts, out, tiny_tokenizer, fake_server, "--max-new-tokens", "48", "--shard-size", "300")
    )
    assert result.exit_code == 0, result.output

    records = read_records(out)
    keys = [r.key for r in PromptReader(prompts)]
    assert sorted(r["id"] for r in records) == sorted(keys)
    assert len({r["id"] for r in records}) == len(records) == 1000

    renderer = Renderer(load_tokenizer(tiny_tokenizer))
    rows = {r.key: r for r in PromptReader(prompts)}
    sampling = {"max_new_tokens": 48, "temperature": 0.0}
    for record in records:
        independent = renderer.tokenizer.apply_chat_template(
            rows[record["id"]].messages,
            tools=served_tools(rows[record["id"]].tools),
            add_generation_prompt=True,
            tokenize=True,
        )
        independent = independent["input_ids"] if hasattr(independent, "keys") else independent
        assert record["prompt_ids"] == list(independent)
        assert record["output_ids"] == expected_output(fake_server.config, record["prompt_ids"], sampling)
        assert record["completion_tokens"] == len(record["output_ids"])
        assert record["key"] == record["id"] and record["sample"] == 0
        if record["finish_reason"]["type"] == "stop":
            assert record["output_ids"][-1] == fake_server.config.eos_id

    shards = sorted(p.name for p in (out / "shards").iterdir())
    assert shards == [
        "shard_00000.ids", "shard_00000.jsonl", "shard_00001.ids", "shard_00001.jsonl",
        "shard_00002.ids", "shard_00002.jsonl", "shard_00003.ids", "shard_00003.jsonl",
    ]  # fmt: skip
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert [s["records"] for s in manifest["shards"]] == [300, 300, 300, 100]
    assert manifest["plan"]["sampling_params"] == sampling
    assert manifest["server"]["sglang_version"] == "0.5.23"
    assert "api_key" not in (out / "manifest.json").read_text()
    assert "records written: 1000 this pass" in result.output


def test_samples_per_prompt_gives_distinct_ids(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--samples-per-prompt", "3"))
    assert result.exit_code == 0, result.output
    ids = Counter(r["id"] for r in read_records(out))
    assert sorted(ids) == ["a#0", "a#1", "a#2", "b#0", "b#1", "b#2"] and set(ids.values()) == {1}


def test_sampling_defaults_come_from_generation_config(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_tokenizer, model)
    (model / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2}')
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "x"}])
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, model, fake_server, "--top-p", "0.9"))
    assert result.exit_code == 0, result.output
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["plan"]["sampling_params"] == {"max_new_tokens": 4096, "temperature": 0.6, "top_p": 0.9}
    assert "generation_config.json + flags" in result.output


def test_run_refuses_a_non_empty_out_dir(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "x"}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server))
    assert result.exit_code == 2
    # No manifest there, so `resume` could not continue anything: it is not suggested.
    assert "is not empty and holds no eagle-datagen run" in result.output and "resume" not in result.output


def test_a_bad_row_stops_the_run_with_file_line_and_fix(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "x"}\n{"messages": "nope"}\n')
    result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, fake_server))
    assert result.exit_code == 2
    assert f"{prompts}:2: 'messages' must be a list" in result.output
    assert "--skip-bad-lines" in result.output


def test_skip_bad_lines_sets_rows_aside(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(
        b'{"prompt": "x"}\nnot json\n{"prompt": "y"}\n{"messages": [{"role": "user", "content": "z"}, {"role": "narrator", "content": "q"}]}\n'
    )
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--skip-bad-lines"))
    assert result.exit_code == 0, result.output
    assert len(read_records(out)) == 2
    rejects = [orjson.loads(line) for line in (out / "rejects.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r["kind"]) for r in rejects] == [(2, "invalid_json"), (4, "unknown_role")]


def test_prompts_too_long_for_the_server_are_set_aside(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    fake_server.update_config(max_req_input_len=40)
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"id": "short", "prompt": "x"}, {"id": "long", "prompt": "word " * 200}]
    )
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server))
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read_records(out)] == ["short"]
    (reject,) = [orjson.loads(line) for line in (out / "rejects.jsonl").read_bytes().splitlines()]
    assert reject["key"] == "long" and reject["kind"] == "too_long" and reject["prompt_tokens"] >= 40


@pytest.mark.parametrize(
    ("knob", "kind"),
    [("leak_prompt_tail", "check_prompt_tail_leak"), ("wrong_completion_tokens", "check_completion_tokens"),
     ("drop_stop_token", "check_stop_token")],
)  # fmt: skip
def test_responses_failing_a_check_are_never_data(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, knob: str, kind: str
) -> None:
    fake_server.update_config(**{knob: True})
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--no-preflight"))
    assert result.exit_code == 3, result.output
    assert read_records(out) == []
    failures = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert sorted(f["id"] for f in failures) == ["a", "b"] and {f["kind"] for f in failures} == {kind}


def test_preflight_failure_stops_before_any_real_request(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    fake_server.update_config(leak_prompt_tail=True)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"x {i}"} for i in range(6)])
    result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, fake_server))
    assert result.exit_code == 1
    assert "preflight request" in result.output and "prompt_tail_leak" in result.output
    # three prompts in a row fail their checks: a server problem, not one record's; no real request was sent
    assert fake_server.stats()["generate_received"] == 3


def test_a_prompt_whose_preflight_fails_its_check_is_held_and_the_next_one_preflights(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume that retries a record which failed its check before (greedy: it fails again) must not stop at the
    preflight: the next prompt is the preflight, the held one is sent once it passed and fails as a record."""
    from eagle_datagen.generate import client

    real = client.parse_generate_response

    def bad_for_first(payload: Any, input_ids: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        if input_ids == first_prompt[0]:
            raise client.RequestFailed("check_think_when_off", "thinking off, yet <think>", retryable=False)
        return real(payload, input_ids, sampling_params, *args, **kwargs)

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"x {i}"} for i in range(5)])
    first_prompt: list[Any] = [Renderer(load_tokenizer(tiny_tokenizer)).render(next(iter(PromptReader(prompts))))]
    monkeypatch.setattr(client, "parse_generate_response", bad_for_first)
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server))
    assert result.exit_code == 3, result.output
    assert sorted(r["id"] for r in read_records(out)) == ["p1", "p2", "p3", "p4"]
    (failure,) = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert failure["id"] == "p0" and failure["kind"] == "check_think_when_off"
    again = invoke("resume", "--out", str(out), "--no-progress")  # the advice works: it retries p0 (which fails)
    assert again.exit_code == 3 and "preflight request" not in again.output, again.output


def test_a_400_is_recorded_with_sglangs_message_and_not_retried(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    fake_server.update_config(context_length=60)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--no-preflight", "--max-new-tokens", "100"))
    assert result.exit_code == 3, result.output
    (failure,) = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert failure["kind"] == "http_400" and failure["attempts"] == 1
    assert "context length" in failure["message"]


def test_render_workers_give_the_same_records(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(300))
    inline, pooled = tmp_path / "inline", tmp_path / "pooled"
    assert invoke(*run_args(prompts, inline, tiny_tokenizer, fake_server)).exit_code == 0
    result = invoke(*run_args(prompts, pooled, tiny_tokenizer, fake_server, "--render-workers", "2"))
    assert result.exit_code == 0, result.output
    assert {r["id"]: r for r in read_records(inline)} == {r["id"]: r for r in read_records(pooled)}


def test_records_carry_wall_clock_stamps_and_their_server(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    import time

    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(20))
    out = tmp_path / "out"
    before = time.time()
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server))
    after = time.time()
    assert result.exit_code == 0, result.output
    records = read_records(out, stamps=True)
    assert len(records) == 20
    for record in records:
        assert before - 0.001 <= record["started"] <= record["finished"] <= after + 0.001
        assert record["server"] == fake_server.url
        # the data fields keep their order: the id first, then prompt_ids and output_ids (verify's fast path)
        order = ["id", "key", "sample", "prompt_ids", "output_ids", "finish_reason", "completion_tokens"]
        assert list(record)[:7] == order
    assert "hit max_new_tokens" in result.output
