"""Render parity against the real SGLang 0.5.23 server on CPU: the client's render equals the serving chat
path's (``POST /v1/tokenize``) for every row shape, and a server started with another ``--chat-template`` is
caught at preflight before any ``/generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.inputs.prompts import parse_row
from eagle_datagen.inputs.render import Renderer, load_tokenizer
from eagle_datagen.server.parity import check_parity, row_shapes
from eagle_datagen.server.tokenize import ServerRenderer
from real_sglang import SGLangServer, start_sglang_server

pytestmark = pytest.mark.sglang

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": {"type": "object"}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
ROWS: list[dict[str, Any]] = [
    {"id": "plain", "prompt": "What is 2+2?"},
    {"id": "system", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
    {"id": "multi", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                                      {"from": "human", "value": "c"}]},
    {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "two"},
                                                              {"type": "text", "text": "parts"}]}]},
    {"id": "tools", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
    {"id": "call-string", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]},
    {"id": "call-object", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "easy", "weight": 0},
        {"role": "user", "content": "Thanks"}]},
]  # fmt: skip


def rows() -> list[Any]:
    return [parse_row(orjson.dumps(r), "rows.jsonl", i) for i, r in enumerate(ROWS, start=1)]


@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}])
def test_the_client_renders_every_row_shape_as_the_serving_path(
    sglang_server: SGLangServer, tiny_kimi_model: Path, kwargs: dict[str, Any]
) -> None:
    renderer = Renderer(load_tokenizer(tiny_kimi_model), kwargs)
    sample = rows()
    assert set().union(*(row_shapes(r) for r in sample)) >= {
        "tools", "tool_calls", "tool_result_end", "system", "multi_turn", "text_parts", "reasoning_history",
    }  # fmt: skip
    with ServerRenderer(sglang_server.url, template_kwargs=kwargs) as server:
        result = check_parity(renderer, server, sample, "rows.jsonl")  # raises on the first difference
        assert result.compared == len(sample) and not result.refused
        served = server.render_many(sample, "rows.jsonl")
    # The serving path's tool schemas are not the row's: a plain apply_chat_template(tools=row.tools) differs.
    tools_row = sample[4]
    plain = renderer.tokenizer.apply_chat_template(
        tools_row.messages, tools=tools_row.tools, add_generation_prompt=True
    )
    assert list(plain["input_ids"] if hasattr(plain, "keys") else plain) != served[4]


@pytest.mark.slow
def test_a_server_with_another_chat_template_is_caught_at_preflight(tiny_kimi_model: Path, tmp_path: Path) -> None:
    template = load_tokenizer(tiny_kimi_model).chat_template
    other = tmp_path / "other.jinja"
    other.write_text(template.replace("<|im_middle|>", "<|im_middle|>\n", 1))  # one newline more, on every turn
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    log_path = tmp_path / "server.log"
    with start_sglang_server(tiny_kimi_model, log_path=log_path, extra_args=["--chat-template", str(other)]) as server:
        args = ["run", "--prompts", str(prompts), "--tokenizer", str(tiny_kimi_model), "--server-url", server.url,
                "--no-progress", "--max-new-tokens", "8"]  # fmt: skip
        caught = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a")])
        assert caught.exit_code == 1, caught.output
        assert "render parity: " in caught.output and "renders differently here and on" in caught.output
        assert "client: " in caught.output and "server: " in caught.output and "position" in caught.output
        assert not list((tmp_path / "a").glob("shards/*"))  # nothing was generated
        served = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b"), "--render", "server"])
        assert served.exit_code == 0, served.output
    manifest = orjson.loads((tmp_path / "b" / "manifest.json").read_bytes())
    assert manifest["plan"]["render"]["renderer"] == "server"
