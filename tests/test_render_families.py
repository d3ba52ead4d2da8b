"""Rendering over every real tokenizer directory in ../shared/real-tokenizers: the three row shapes, tool calls
with string and object arguments, a row ending with a tool result, thinking on/off, date pinning, bad rows."""

from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from eagle_datagen.errors import BadInputError
from eagle_datagen.inputs.prompts import PromptReader, PromptRow, parse_row
from eagle_datagen.inputs.render import (
    Renderer,
    count_rows_with_tools,
    load_tokenizer,
    pin_template_date,
    render_plan,
    renderer_for_plan,
    template_notes,
)

REAL = Path(os.environ.get("EAGLE_REAL_TOKENIZERS", Path(__file__).resolve().parents[2] / "shared" / "real-tokenizers"))
FAMILIES = sorted(p.name for p in REAL.iterdir() if (p / "tokenizer_config.json").is_file()) if REAL.is_dir() else []
pytestmark = pytest.mark.skipif(not FAMILIES, reason=f"no real tokenizers at {REAL} (set EAGLE_REAL_TOKENIZERS)")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@functools.cache
def tokenizer(name: str) -> Any:
    return load_tokenizer(REAL / name, trust_remote_code=True)


@functools.cache
def renderer(name: str, **kwargs: Any) -> Renderer:
    return Renderer(tokenizer(name), kwargs, render_date=datetime.date(2025, 3, 4))


def row(obj: dict[str, Any], line: int = 1) -> PromptRow:
    return parse_row(json.dumps(obj).encode(), "p.jsonl", line)


def reference(name: str, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> list[int]:
    """An independent render: the template to text (with the pinned date's template), then encode it."""
    tok = tokenizer(name)
    template = tok.chat_template
    if "strftime_now" in template:
        template = pin_template_date(template, datetime.date(2025, 3, 4))
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, chat_template=template, **kwargs
    )
    return list(tok.encode(text, add_special_tokens=False))


def tool_call_row(arguments: Any, *, end_with_tool: bool = True) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    if not end_with_tool:
        messages += [{"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks!"}]
    return {"id": "t", "messages": messages, "tools": TOOLS}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_three_row_shapes_render_as_the_template_does(name: str) -> None:
    shapes = [
        ({"prompt": "What is 2+2?"}, [{"role": "user", "content": "What is 2+2?"}]),
        (
            {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]},
            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
        ),
        (
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                               {"from": "human", "value": "What is 2+2?"}]},
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "What is 2+2?"}],
        ),
    ]  # fmt: skip
    for obj, messages in shapes:
        assert renderer(name).render(row(obj)) == reference(name, messages)


@pytest.mark.parametrize("name", FAMILIES)
def test_tool_call_arguments_as_string_or_object_render_the_same(name: str) -> None:
    as_string = renderer(name).render(row(tool_call_row('{"city": "Paris"}')))
    as_object = renderer(name).render(row(tool_call_row({"city": "Paris"})))
    assert as_string == as_object
    text = tokenizer(name).decode(as_string)
    assert '{"city": "Paris"}' in text
    assert '"{\\"city' not in text  # never JSON-encoded twice (gpt-oss's template does that to a string)
    assert "{'city'" not in text  # never a Python repr


@pytest.mark.parametrize("name", FAMILIES)
def test_tools_reach_the_template_as_the_serving_path_dumps_them(name: str) -> None:
    """SGLang's pydantic Tool dump adds ``defer_loading: null``; a template printing schemas as JSON shows it."""
    r = renderer(name)
    ids = r.render(row({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}))
    served = [{**TOOLS[0], "defer_loading": None}]
    assert ids == reference(name, [{"role": "user", "content": "hi"}], tools=served)


def test_templates_that_need_string_arguments_or_drop_tools_are_found_by_rendering() -> None:
    traits = {name: renderer(name).traits for name in FAMILIES}
    assert {n for n, t in traits.items() if t.needs_string_arguments} == {"deepseek-r1-distill-qwen"} & set(FAMILIES)
    assert {n for n, t in traits.items() if t.drops_tools} == {"deepseek-r1-distill-qwen"} & set(FAMILIES)
    assert {n for n, t in traits.items() if t.date_dependent} == {"gpt-oss"} & set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_row_ending_with_a_tool_result(name: str) -> None:
    ids = renderer(name).render(row(tool_call_row({"city": "Paris"})))
    tail = tokenizer(name).decode(ids[-12:])
    if name == "deepseek-r1-distill-qwen":  # no generation prompt after a tool result
        assert tail.endswith("<｜tool▁outputs▁end｜>")
    else:
        plain = renderer(name).render(row({"prompt": "x"}))
        assert ids[-3:] == plain[-3:]  # the same generation prompt as any other row
    longer = renderer(name).render(row(tool_call_row({"city": "Paris"}, end_with_tool=False)))
    assert len(longer) > len(ids)


SWITCHES = {
    "qwen3-hybrid": ({"enable_thinking": False}, [151667, 271, 151668, 271], [151644, 77091, 198]),
    "kimi-k2.5-synthvocab": ({"thinking": False}, [163601, 163606, 163607], [163601, 163606]),
    "kimi-k2.5-synthvocab-fast": ({"thinking": False}, [163601, 163606, 163607], [163601, 163606]),
}


@pytest.mark.parametrize("name", sorted(set(SWITCHES) & set(FAMILIES)))
def test_thinking_on_and_off(name: str) -> None:
    off_kwargs, off_tail, on_tail = SWITCHES[name]
    plain = row({"prompt": "What is 2+2?"})
    on = renderer(name).render(plain)
    off = Renderer(tokenizer(name), off_kwargs).render(plain)
    assert on[-len(on_tail) :] == on_tail
    assert off[-len(off_tail) :] == off_tail
    assert off == reference(name, plain.messages, **off_kwargs)


@pytest.mark.skipif("gpt-oss" not in FAMILIES, reason="needs gpt-oss")
def test_a_date_dependent_template_renders_the_pinned_date() -> None:
    tok = tokenizer("gpt-oss")
    plain = row({"prompt": "hi"})
    pinned = Renderer(tok, render_date=datetime.date(2025, 3, 4))
    assert "Current date: 2025-03-04\n" in tok.decode(pinned.render(plain))
    assert render_plan(pinned) == {"renderer": "client", "date": "2025-03-04"}
    again = renderer_for_plan(tok, {"chat_template_kwargs": {}, "render": render_plan(pinned)})
    assert again.render(plain) == pinned.render(plain)
    today = Renderer(tok)  # not pinned: the clock, as transformers renders it
    assert today.render(plain) == list(tok.apply_chat_template(plain.messages, add_generation_prompt=True)["input_ids"])
    assert render_plan(renderer("qwen3-hybrid"))["date"] is None  # a template without a date pins none


def test_pinning_keeps_every_other_byte_and_formats_any_directive() -> None:
    template = "\n{%- macro f() %}{{ strftime_now('%d %b %Y %% %-d/%-m %A') }}{% endmacro %}[{{ f() }}]"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert env.from_string(pin_template_date(template, datetime.date(2025, 3, 4))).render() == (
        "[04 Mar 2025 % 4/3 Tuesday]"
    )
    leading = "\n\nA{{ 1 }}"
    assert (
        env.from_string(pin_template_date(leading, datetime.date(2025, 3, 4))).render()
        == env.from_string(leading).render()
    )


@pytest.mark.parametrize(
    ("arguments", "kind", "detail"),
    [
        ('{"city": "Par', "bad_tool_arguments", "not valid JSON"),
        ('["Paris"]', "bad_tool_arguments", "holds JSON list, not an object"),
        (42, "bad_tool_arguments", "must be a JSON object or a string holding one"),
    ],
)
def test_bad_tool_call_arguments_are_bad_rows_naming_the_line(arguments: Any, kind: str, detail: str) -> None:
    with pytest.raises(BadInputError) as info:
        row(tool_call_row(arguments), line=7)
    assert info.value.kind == kind and info.value.line == 7
    assert str(info.value).startswith("p.jsonl:7: messages[1].tool_calls[0].function.arguments")
    assert detail in str(info.value)


def test_a_bare_tool_schema_is_a_bad_row_with_the_fix() -> None:
    with pytest.raises(BadInputError, match=r'wrap a bare schema as \{"type": "function"'):
        row({"prompt": "x", "tools": [{"name": "get_weather", "parameters": {}}]})


def test_a_tool_call_in_a_dropped_trailing_reply_is_not_judged() -> None:
    obj = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "junk"}]}
    assert row(obj).messages == [{"role": "user", "content": "x"}]


@pytest.mark.skipif("gpt-oss" not in FAMILIES, reason="needs gpt-oss")
def test_a_row_the_family_template_rejects_names_file_line_and_the_templates_message(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "fine"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "orphan"}]}) + "\n"
    )  # fmt: skip
    rows = list(PromptReader(prompts))
    first, second = renderer("gpt-oss").render_many(rows, str(prompts))
    assert isinstance(first, list)
    assert isinstance(second, BadInputError) and second.kind == "template_error"
    assert str(second).startswith(f"{prompts}:2: the chat template raised: Message has tool role, but there was no")
    assert "--skip-bad-lines" in str(second)


@pytest.mark.skipif("deepseek-r1-distill-qwen" not in FAMILIES, reason="needs deepseek")
def test_a_template_that_drops_tools_is_a_warning_with_the_rows_affected(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = [tool_call_row({"city": "Paris"}), {"prompt": "no tools"}, {"prompt": "empty", "tools": []}]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{not json, "tools"\n')
    assert count_rows_with_tools(prompts) == 1
    notes = template_notes(renderer("deepseek-r1-distill-qwen"), prompts)
    assert any("ignores `tools`: 1 row(s)" in n for n in notes)
    assert any("needs tool-call arguments as JSON strings" in n for n in notes)
    assert not [n for n in template_notes(renderer("qwen3-hybrid"), prompts) if n.startswith("warning")]


def test_content_parts_reach_the_templates_sglang_keeps_them_for() -> None:
    """SGLang 0.5.23's detect_jinja_template_content_format (measured in .venv-sglang): 'openai' for the Kimi
    templates (they name media), 'string' for the others."""
    kept = {name for name in FAMILIES if renderer(name).keeps_content_parts}
    assert kept == {"kimi-k2.5-synthvocab", "kimi-k2.5-synthvocab-fast"} & set(FAMILIES)
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]
    }
    for name in FAMILIES:
        content = parts["messages"][0]["content"] if name in kept else "two parts"
        assert renderer(name).render(row(parts)) == reference(name, [{"role": "user", "content": content}])
