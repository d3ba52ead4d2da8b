"""Exactness against the real engine: `eagle-datagen run` on a real SGLang 0.5.23 server on CPU.

Each record's prompt_ids must equal an independent transformers render, and its output_ids must
equal transformers' greedy generate() of the same float32 random-weight model, prompt by prompt
(random weights make every prompt's answer its own, so records swapped between prompts show).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, served_tools, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.inputs.prompts import parse_row
from eagle_datagen.inputs.render import generation_eos_ids
from real_sglang import SGLangServer, build_model_in_venv, hf_greedy, start_sglang_server

pytestmark = pytest.mark.sglang
MAX_NEW_TOKENS = 24

ROWS: list[dict[str, Any]] = [
    {"id": "short", "prompt": "hi"},
    {"id": "math", "prompt": "What is 17 times 23? Show your steps."},
    {"id": "system", "messages": [{"role": "system", "content": "You answer in one word."},
                                  {"role": "user", "content": "Name a colour of the sky at dusk."}]},
    {"id": "multi", "messages": [{"role": "user", "content": "Tell me a fact about owls."},
                                 {"role": "assistant", "content": "Owls can rotate their heads a long way."},
                                 {"role": "user", "content": "How far, exactly, and why can they do it?"}]},
    {"id": "sharegpt", "conversations": [{"from": "human", "value": "Summarise the water cycle."},
                                         {"from": "gpt", "value": "dropped"}]},
    {"id": "long", "prompt": " ".join(f"word{i}" for i in range(150))},
    {"id": "tools", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
    {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]},
]  # fmt: skip


def render(model: Path, row: dict[str, Any], **kwargs: Any) -> list[int]:
    """An independent render with transformers, outside eagle-datagen's code."""
    from transformers import AutoTokenizer

    parsed = parse_row(orjson.dumps(row), "rows", 1)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.apply_chat_template(
        parsed.messages, tools=served_tools(parsed.tools), add_generation_prompt=True, tokenize=True, **kwargs
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_and_check(
    tmp_path: Path, model: Path, server: SGLangServer, *extra: str, **kwargs: Any
) -> list[dict[str, Any]]:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--tokenizer", str(model), "--server-url", server.url, "--out", str(out),
         "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress", *extra],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in read_records(out)}
    assert sorted(records) == sorted(r["id"] for r in ROWS)
    expected_prompts = {row["id"]: render(model, row, **kwargs) for row in ROWS}
    greedy = dict(zip(expected_prompts, hf_greedy(model, list(expected_prompts.values()), MAX_NEW_TOKENS), strict=True))
    eos = set(generation_eos_ids(model))
    for key, record in records.items():
        assert record["prompt_ids"] == expected_prompts[key], key
        assert record["output_ids"] == greedy[key], key
        assert record["completion_tokens"] == len(record["output_ids"])
        if record["finish_reason"]["type"] == "stop":
            assert record["output_ids"][-1] in eos and record["output_ids"][-1] == record["finish_reason"]["matched"]
        else:
            assert len(record["output_ids"]) == MAX_NEW_TOKENS
    assert len({tuple(r["output_ids"]) for r in records.values()}) > len(records) // 2, (
        "answers should differ by prompt"
    )
    verify = CliRunner().invoke(main, ["verify-shard", str(out), "--json"], catch_exceptions=False)
    assert '"prompt_mismatch"' not in verify.output and '"stop_token"' not in verify.output
    return list(records.values())


def test_records_equal_transformers_render_and_greedy(
    tmp_path: Path, tiny_kimi_model: Path, sglang_server: SGLangServer
) -> None:
    records = run_and_check(tmp_path, tiny_kimi_model, sglang_server)
    think = render(tiny_kimi_model, {"prompt": "x"})[-1]
    assert all(r["prompt_ids"][-1] == think for r in records)  # the template's <think> ends every prompt


def test_thinking_false_renders_an_empty_think_block(
    tmp_path: Path, tiny_kimi_model: Path, sglang_server: SGLangServer
) -> None:
    records = run_and_check(
        tmp_path, tiny_kimi_model, sglang_server, "--chat-template-kwargs", '{"thinking": false}', thinking=False
    )
    tail = render(tiny_kimi_model, {"prompt": "x"}, thinking=False)[-2:]
    assert all(r["prompt_ids"][-2:] == tail for r in records)


@pytest.fixture(scope="module")
def kimi_ids_server(
    sglang_venv_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, SGLangServer]]:
    model = build_model_in_venv(tmp_path_factory.mktemp("kimi-ids") / "model", "--template", "kimi", "--kimi-ids",
                                "--weights", "random", "--dtype", "float32")  # fmt: skip
    with start_sglang_server(model, log_path=model.parent / "server.log") as server:
        yield model, server


def test_kimi_real_ids(tmp_path: Path, kimi_ids_server: tuple[Path, SGLangServer]) -> None:
    model, server = kimi_ids_server
    records = run_and_check(tmp_path, model, server)
    assert all(r["prompt_ids"][-1] == 163606 for r in records)  # Kimi-K2.5's <think>
    stops = [r for r in records if r["finish_reason"]["type"] == "stop"]
    assert all(r["output_ids"][-1] == 163586 for r in stops)  # <|im_end|>
