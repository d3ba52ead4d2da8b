"""The tool-call script of the tiny models (`script="tool_call"`): its tokenizer holds the reply once per token,
transformers' greedy and a real SGLang 0.5.23 server on CPU both give it, and SGLang's own parsers split it into
reasoning, an answer and one `get_weather` call (Kimi-K2 markup for the kimi template, Qwen's for chatml)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from eagle_datagen.server.parsers import ParsedReply, parse_reply, reply_text
from eagle_datagen.testing.tiny import (
    END_THINK,
    IM_END,
    KIMI_IDS,
    KIMI_TOOL_IDS,
    THINK,
    TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    Template,
    build_tiny_tokenizer,
    script_ids,
    tool_script,
)
from real_sglang import SGLangServer, hf_greedy

TEMPLATES: list[Template] = ["kimi", "chatml"]
MAX_NEW_TOKENS = 40
CALL_IDS: dict[str, str] = {"kimi": "functions.get_weather:0", "chatml": "call_0"}


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """Prompt ids with the generation prompt (transformers 5 returns a mapping, 4 a list)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def conversations(template: Template) -> list[list[dict[str, Any]]]:
    """A first turn, one with a system prompt, and a third turn after the script's own call and its result."""
    script = tool_script(template)
    earlier = {
        "role": "assistant",
        "content": script.answer,
        "reasoning_content": script.reasoning,
        "tool_calls": [
            {
                "id": CALL_IDS[template],
                "type": "function",
                "function": {"name": script.call_name, "arguments": json.loads(script.call_arguments)},
            }
        ],
    }
    tool_result = {"role": "tool", "tool_call_id": CALL_IDS[template], "content": '{"temp_c": 21}'}
    return [
        [{"role": "user", "content": "Weather in Paris?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        [{"role": "user", "content": "Weather in Paris?"}, earlier, tool_result, {"role": "user", "content": "Again?"}],
    ]


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_tool_script_tokenizer_holds_the_reply_once_per_token(tmp_path: Path, template: Template) -> None:
    script = tool_script(template)
    plain_dir = build_tiny_tokenizer(tmp_path / "plain", template=template)
    tool_dir = build_tiny_tokenizer(tmp_path / "tool", template=template, script="tool_call")
    plain, tool = AutoTokenizer.from_pretrained(str(plain_dir)), AutoTokenizer.from_pretrained(str(tool_dir))
    # Every id of the plain build keeps its value: the tool-call tokens come after.
    plain_vocab, tool_vocab = plain.get_vocab(), tool.get_vocab()
    assert {t: tool_vocab[t] for t in plain_vocab} == plain_vocab and len(tool_vocab) > len(plain_vocab)
    chain = script_ids(tool_dir, "tool_call")
    assert chain[0] == tool.convert_tokens_to_ids(THINK) and chain[-1] == tool.eos_token_id
    assert len(set(chain)) == len(chain) and END_THINK in tool.convert_ids_to_tokens(chain)
    assert tool.decode(chain[1:-1], skip_special_tokens=False) == script.reply
    assert tool.encode(script.reply, add_special_tokens=False) == chain[1:-1]
    assert tool.eos_token == IM_END
    tokens = tool.convert_ids_to_tokens(chain)
    if template == "kimi":  # the Kimi-K2 markers are whole special tokens
        markers = [TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END, TOOL_CALLS_END]
        assert [t for t in tokens if t.startswith("<|tool_call")] == markers
        assert set(markers) <= set(tool.all_special_tokens)
    else:  # Qwen's tags are added tokens, not special ones (skip_special_tokens keeps them, as Qwen3's do)
        assert "<tool_call>" in tool.decode(chain[1:-1], skip_special_tokens=True)
    # The template renders the same history in both builds (only the tokens differ).
    for messages in conversations(template):
        text = tool.apply_chat_template(messages, tools=script.tools, add_generation_prompt=True, tokenize=False)
        assert text == plain.apply_chat_template(
            messages, tools=script.tools, add_generation_prompt=True, tokenize=False
        )
        ids = render(tool, messages, tools=script.tools)
        assert ids[-1] == chain[0] and tool.decode(ids, skip_special_tokens=False) == text


def test_the_tool_script_with_kimi_ids_uses_kimis_real_marker_ids(tmp_path: Path) -> None:
    tok_dir = build_tiny_tokenizer(tmp_path / "k", template="kimi", kimi_ids=True, script="tool_call")
    chain = script_ids(tok_dir, "tool_call")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for token, tid in {**KIMI_IDS, **KIMI_TOOL_IDS}.items():
        assert tok.convert_tokens_to_ids(token) == tid
    assert {163595, *KIMI_TOOL_IDS.values()} <= set(chain) and len(set(chain)) == len(chain)
    assert tok.decode(chain[1:-1], skip_special_tokens=False) == tool_script("kimi").reply


def test_a_plain_tokenizer_has_no_tool_script(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="build it with script='tool_call'"):
        script_ids(build_tiny_tokenizer(tmp_path / "c", template="chatml"), "tool_call")


@pytest.fixture(scope="module")
def greedy(tool_kimi_model: Path, tool_chatml_model: Path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt ids, transformers greedy ids) per template; computed before any server starts (2 cores)."""
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    models: list[tuple[Template, Path]] = [("kimi", tool_kimi_model), ("chatml", tool_chatml_model)]
    for template, model in models:
        tok = AutoTokenizer.from_pretrained(str(model))
        prompts = [render(tok, m, tools=tool_script(template).tools) for m in conversations(template)]
        out[template] = list(zip(prompts, hf_greedy(model, prompts, MAX_NEW_TOKENS), strict=True))
    return out


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("template", TEMPLATES)
def test_transformers_greedy_replies_the_script_every_turn(
    greedy: dict[str, list[tuple[list[int], list[int]]]], template: Template, request: pytest.FixtureRequest
) -> None:
    model: Path = request.getfixturevalue(f"tool_{template}_model")
    chain = script_ids(model, "tool_call")
    assert json.loads((model / "tiny_model.json").read_text())["script_ids"] == chain
    assert [output for _, output in greedy[template]] == [chain[1:]] * len(conversations(template))


def parse(url: str, text: str, template: Template) -> ParsedReply:
    script = tool_script(template)

    async def go() -> ParsedReply:
        async with httpx.AsyncClient(timeout=60) as http:
            return await parse_reply(
                http, url, text, reasoning_parser=script.reasoning_parser,
                tool_call_parser=script.tool_call_parser, tools=script.tools, call_id=lambda i: f"call_{i}",
            )  # fmt: skip

    return asyncio.run(go())


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("template", TEMPLATES)
def test_real_sglang_serves_the_script_and_its_parsers_split_it(
    greedy: dict[str, list[tuple[list[int], list[int]]]], template: Template, request: pytest.FixtureRequest
) -> None:
    server: SGLangServer = request.getfixturevalue(f"tool_{template}_server")
    model: Path = request.getfixturevalue(f"tool_{template}_model")
    tok = AutoTokenizer.from_pretrained(str(model))
    script = tool_script(template)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for ids, want in greedy[template]:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
            response = client.post("/generate", json=body)
            assert response.status_code == 200, response.text
            result = response.json()
            assert result["output_ids"] == want
            assert result["meta_info"]["finish_reason"]["type"] == "stop"
    output = greedy[template][0][1]
    opener = tok.decode(greedy[template][0][0][-1:], skip_special_tokens=False)
    text = reply_text(tok, output, [tok.eos_token_id], opened_by_prompt=opener)
    assert text == THINK + script.reply
    reply = parse(server.url, text, template)
    assert reply.reasoning_content == script.reasoning
    assert reply.content == script.answer
    assert reply.tool_calls == [
        {"id": CALL_IDS[template], "type": "function",
         "function": {"name": "get_weather", "arguments": script.call_arguments}},
    ]  # fmt: skip
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
