"""Rendering with a real transformers tokenizer and a template that ends with <think>."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.prompts import PromptRow
from eagle_datagen.inputs.render import Renderer, as_token_ids, load_tokenizer, tokenizer_facts, tokenizer_fingerprint


def reference(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """An independent render: the template to text, then the tokenizer without special tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_render_matches_apply_chat_template_and_ends_with_think(tiny_tokenizer: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer)
    facts = tokenizer_facts(tokenizer, tiny_tokenizer)
    row = PromptRow("k", 1, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}])
    ids = Renderer(tokenizer).render(row)
    assert ids == reference(tokenizer, row.messages)
    assert facts.think_open_id is not None and ids[-1] == facts.think_open_id


def test_thinking_false_ends_with_empty_think_block(tiny_tokenizer: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer)
    facts = tokenizer_facts(tokenizer, tiny_tokenizer)
    ids = Renderer(tokenizer, {"thinking": False}).render(PromptRow("k", 1, [{"role": "user", "content": "hi"}]))
    assert ids[-2:] == [facts.think_open_id, facts.think_close_id]


def test_text_parts_reach_templates_that_loop_over_them(tiny_tokenizer: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer)
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    renderer = Renderer(tokenizer)
    assert renderer.keeps_content_parts  # the Kimi-style template iterates over m.content
    ids = renderer.render(PromptRow("k", 1, [{"role": "user", "content": parts}]))
    assert ids == reference(tokenizer, [{"role": "user", "content": parts}])


def test_text_parts_join_with_a_space_for_string_templates(tiny_tokenizer: Path) -> None:
    """Like SGLang's serving path for templates that expect a string content."""
    tokenizer = load_tokenizer(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("for part in m.content", "for part in m.other")
    renderer = Renderer(tokenizer)
    assert not renderer.keeps_content_parts
    message = renderer._template_message(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert message == {"role": "user", "content": "a b"}


def test_tools_reach_the_template(tiny_tokenizer: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer)
    tools = [{"type": "function", "function": {"name": "lookup_weather"}}]
    with_tools = Renderer(tokenizer).render(PromptRow("k", 1, [{"role": "user", "content": "x"}], tools))
    without = Renderer(tokenizer).render(PromptRow("k", 1, [{"role": "user", "content": "x"}]))
    assert len(with_tools) > len(without)


def test_a_template_that_raises_is_a_bad_row(tiny_tokenizer: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer)
    row = PromptRow("k", 9, [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}])
    with pytest.raises(BadInputError) as info:
        Renderer(tokenizer).render(row, "p.jsonl")
    assert info.value.kind == "template_error" and info.value.line == 9
    assert str(info.value).startswith("p.jsonl:9: the chat template raised:")


def test_missing_tokenizer_and_missing_template_are_usage_errors(tmp_path: Path, tiny_tokenizer: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    import shutil

    copy = tmp_path / "no-template"
    shutil.copytree(tiny_tokenizer, copy)
    config = (copy / "tokenizer_config.json").read_text()
    import json

    data = json.loads(config)
    data.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(data))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(UsageError, match="no chat template"):
        load_tokenizer(copy)


def test_fingerprint_changes_with_the_template(tmp_path: Path, tiny_tokenizer: Path) -> None:
    import shutil

    copy = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer, copy)
    before = tokenizer_fingerprint(copy)
    assert before == tokenizer_fingerprint(tiny_tokenizer)
    (copy / "tokenizer_config.json").write_text(
        (copy / "tokenizer_config.json").read_text().replace("assistant", "assistent")
    )
    assert tokenizer_fingerprint(copy) != before


@pytest.mark.parametrize(
    "result",
    [[1, 2, 3], {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}, {"input_ids": [[1, 2, 3]]}, [[1, 2, 3]]],
)
def test_as_token_ids_accepts_transformers_4_and_5_shapes(result: Any) -> None:
    assert as_token_ids(result) == [1, 2, 3]
