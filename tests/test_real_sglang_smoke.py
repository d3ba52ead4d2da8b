"""Tiny tokenizers/models, and a real SGLang server on CPU matching transformers' greedy ids."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from eagle_datagen.testing.tiny import KIMI_IDS, KIMI_VOCAB_SIZE, build_tiny_tokenizer, script_ids
from real_sglang import SGLangServer, build_model_in_venv, hf_greedy

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}],
    [
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": "sunny"},
        {"role": "user", "content": "and Tokyo tomorrow?"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}]
MAX_NEW_TOKENS = 24


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """Prompt ids with the generation prompt (transformers 5 returns a mapping, 4 a list)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("template", ["kimi", "chatml"])
def test_tiny_tokenizer_builds_and_loads(tmp_path: Path, template: str) -> None:
    tok_dir = build_tiny_tokenizer(tmp_path / template, template=template)  # type: ignore[arg-type]
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in config
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert tok.eos_token == "<|im_end|>"
    for messages in CONVERSATIONS:
        ids = render(tok, messages)
        assert ids[-1] == think
        assert render(tok, messages, thinking=False)[-2:] == [think, end_think]
        assert tok.decode(ids) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(render(tok, CONVERSATIONS[0], tools=TOOLS)) > len(render(tok, CONVERSATIONS[0]))
    assert "lookup_weather" in tok.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False)
    with pytest.raises(TemplateError, match="Unknown role: narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_tiny_tokenizer_with_kimi_ids(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "k", template="kimi", kimi_ids=True)))
    assert len(tok) == KIMI_VOCAB_SIZE
    for token, tid in KIMI_IDS.items():
        assert tok.convert_tokens_to_ids(token) == tid
        assert tok.encode(token, add_special_tokens=False) == [tid]
    assert tok.eos_token_id == 163586
    ids = render(tok, CONVERSATIONS[1])
    assert ids[0] == 163594 and ids[-1] == 163606
    assert render(tok, CONVERSATIONS[1], thinking=False)[-2:] == [163606, 163607]
    chain = script_ids(tmp_path / "k")
    assert chain[0] == 163606 and chain[-1] == 163586 and 163607 in chain and len(set(chain)) == len(chain)


@pytest.mark.sglang
@pytest.mark.usefixtures("sglang_venv_python")
def test_scripted_model_follows_its_script_in_transformers(tmp_path: Path) -> None:
    model_dir = build_model_in_venv(
        tmp_path / "m", "--template", "chatml", "--weights", "scripted", "--dtype", "bfloat16"
    )
    chain = script_ids(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [render(tok, CONVERSATIONS[1]), render(tok, CONVERSATIONS[1], thinking=False)]
    assert hf_greedy(model_dir, prompts, 40) == [chain[1:], chain[chain.index(prompts[1][-1]) + 1 :]]


@pytest.fixture(scope="session")
def greedy_reference(tiny_kimi_model: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers greedy ids); computed before the server starts (2 cores)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_kimi_model))
    prompts = [render(tok, m) for m in CONVERSATIONS] + [render(tok, CONVERSATIONS[0], thinking=False)]
    return list(zip(prompts, hf_greedy(tiny_kimi_model, prompts, MAX_NEW_TOKENS), strict=True))


@pytest.mark.sglang
def test_real_sglang_generate_matches_transformers_greedy(
    greedy_reference: list[tuple[list[int], list[int]]], sglang_server: SGLangServer, tiny_kimi_model: Path
) -> None:
    eos_id = AutoTokenizer.from_pretrained(str(tiny_kimi_model)).eos_token_id
    with httpx.Client(base_url=sglang_server.url, timeout=60) as client:
        for ids, want in greedy_reference:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
            response = client.post("/generate", json=body)
            assert response.status_code == 200, response.text
            result = response.json()
            finish = result["meta_info"]["finish_reason"]
            assert result["meta_info"]["prompt_tokens"] == len(ids)
            assert result["output_ids"] == want
            if finish["type"] == "stop":
                assert result["output_ids"][-1] == eos_id
            else:
                assert finish == {"type": "length", "length": MAX_NEW_TOKENS}
