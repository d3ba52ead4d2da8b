"""SGLang's own parsers on a real SGLang 0.5.23 server (no --reasoning-parser): a generated reply becomes the
assistant message serving would keep, and the history built from it renders the same on both sides."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle_datagen.server.parsers import ParsedReply, parse_reply, reply_text

pytestmark = pytest.mark.sglang

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.fixture(scope="module")
def kimi_tokenizer(tiny_kimi_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_kimi_model), trust_remote_code=True)


def parse(url: str, text: str, **kwargs: Any) -> ParsedReply:
    async def go() -> ParsedReply:
        async with httpx.AsyncClient(timeout=60) as http:
            return await parse_reply(
                http, url, text, reasoning_parser=kwargs.pop("reasoning_parser", "kimi_k2"),
                tool_call_parser=kwargs.pop("tool_call_parser", "kimi_k2"), tools=kwargs.pop("tools", TOOLS),
                call_id=lambda i: f"k@t1:{i}", **kwargs,
            )  # fmt: skip

    return asyncio.run(go())


def test_the_prompt_side_opener_is_needed_and_the_stop_token_left_out(sglang_server: Any, kimi_tokenizer: Any) -> None:
    eos = kimi_tokenizer.convert_tokens_to_ids("<|im_end|>")
    output = [*kimi_tokenizer.encode("one plus two</think>three", add_special_tokens=False), eos]
    text = reply_text(kimi_tokenizer, output, [eos], opened_by_prompt="<think>")
    assert text == "<think>one plus two</think>three"
    assert parse(sglang_server.url, text).message() == {
        "role": "assistant", "content": "three", "reasoning_content": "one plus two",
    }  # fmt: skip
    # Without the opener SGLang's parser finds no reasoning at all: why reply_text takes it.
    bare = reply_text(kimi_tokenizer, output, [eos])
    assert parse(sglang_server.url, bare).reasoning_content is None  # serving reports an empty reasoning as null


def test_tool_calls_get_serving_ids_and_raw_arguments(sglang_server: Any) -> None:
    reply = parse(sglang_server.url, f"<think>look it up</think>Checking.{CALL}", earlier_calls=2)
    assert reply.reasoning_content == "look it up"
    assert reply.content.strip() == "Checking."
    assert reply.tool_calls == [
        {"id": "functions.get_weather:2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]  # fmt: skip
    # Another parser's ids would be random on the serving path: ours come from the record.
    other = parse(sglang_server.url, f"<think>x</think>{CALL}", tool_call_parser="kimi_k2", earlier_calls=0)
    assert other.tool_calls[0]["id"] == "functions.get_weather:0"
    # No tools, no parse: the markup stays in the answer.
    untouched = parse(sglang_server.url, f"<think>x</think>{CALL}", tools=[])
    assert untouched.tool_calls == [] and "<|tool_calls_section_begin|>" in untouched.content


def test_history_from_the_parsed_reply_renders_as_serving_once_arguments_are_parsed(
    sglang_server: Any, kimi_tokenizer: Any
) -> None:
    """The parsers give ``arguments`` as the model's JSON text. SGLang's chat path parses it into an object
    before templating (``normalize_assistant_tool_call_arguments``) and validates each call with its pydantic
    ``ToolCall``, whose dump adds ``"index": null`` (measured, like ``defer_loading`` on tools). A client render of
    the raw message differs from serving's (the tiny template prints whole calls); it matches once the message
    is what serving hands the template."""
    import json

    reply = parse(sglang_server.url, f"<think>look it up</think>Checking.{CALL}")

    def conversation(assistant: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "Weather in Paris?"},
            assistant,
            {"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": '{"temp_c": 21}'},
            {"role": "user", "content": "And tomorrow?"},
        ]

    def client(messages: list[dict[str, Any]]) -> list[int]:
        ids = kimi_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    served = httpx.post(
        f"{sglang_server.url}/v1/tokenize",
        json={"model": "default", "messages": conversation(reply.message()), "add_generation_prompt": True},
        timeout=60,
    )
    assert served.status_code == 200, served.text
    tokens = served.json()["tokens"]
    assert client(conversation(reply.message())) != tokens  # raw JSON text: not what serving renders
    normalized = reply.message()
    normalized["tool_calls"] = [
        {"id": call["id"], "index": None, "type": call["type"],
         "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
        for call in normalized["tool_calls"]
    ]  # fmt: skip
    assert client(conversation(normalized)) == tokens
