"""Prompt rows: shapes, keys, and every kind of bad row (named by file:line with a fix)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from conftest import write_jsonl
from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.prompts import PromptReader, parse_row


def parse(obj: object) -> object:
    return parse_row(orjson.dumps(obj), "p.jsonl", 7)


def test_openai_shape_keeps_tools_and_drops_trailing_assistant() -> None:
    row = parse(
        {
            "id": "a",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "x"},
                {"role": "assistant", "content": "y"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
    )
    assert row.key == "a"
    assert [m["role"] for m in row.messages] == ["system", "user"]
    assert row.tools == [{"type": "function", "function": {"name": "f"}}]
    assert row.line == 7


def test_sharegpt_shape_maps_roles() -> None:
    row = parse({"id": 3, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}]})
    assert row.key == "3"
    assert row.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "h"}]


def test_sharegpt_with_role_content_items() -> None:
    row = parse({"conversations": [{"role": "user", "content": "h"}, {"role": "assistant", "content": "a"}]})
    assert row.messages == [{"role": "user", "content": "h"}]


def test_prompt_shape_is_one_user_turn() -> None:
    assert parse({"prompt": "hello"}).messages == [{"role": "user", "content": "hello"}]


def test_hashed_key_is_stable_and_content_sensitive() -> None:
    a = parse({"prompt": "hello"})
    b = parse({"messages": [{"role": "user", "content": "hello"}]})
    c = parse({"prompt": "hello!"})
    assert a.key == b.key and a.key.startswith("h:")
    assert a.key != c.key


def test_text_parts_are_kept_and_validated() -> None:
    row = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]})
    assert row.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "not_object"),
        (b'{"id": 1}', "no_conversation"),
        (b'{"messages": []}', "empty_conversation"),
        (b'{"conversations": []}', "empty_conversation"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "unknown_role"),
        (b'{"conversations": [{"from": "bot", "value": "x"}]}', "unknown_role"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}', "non_text_content"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "bad_content"),
        (b'{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}', "no_user_turn"),
        (b'{"prompt": ""}', "bad_prompt"),
        (b'{"prompt": "x", "messages": []}', "ambiguous_row"),
        (b'{"id": [1], "prompt": "x"}', "bad_id"),
        (b'{"id": true, "prompt": "x"}', "bad_id"),
        (b'{"prompt": "x", "tools": "add"}', "bad_tools"),
        (b'{"prompt": "\xff\xfe"}', "invalid_utf8"),
    ],
)
def test_bad_rows_name_file_line_and_fix(raw: bytes, kind: str) -> None:
    with pytest.raises(BadInputError) as info:
        parse_row(raw, "prompts.jsonl", 42)
    assert info.value.kind == kind
    message = str(info.value)
    assert message.startswith("prompts.jsonl:42: ")
    assert "--skip-bad-lines" in message


def test_reader_streams_and_reports_duplicate_ids_with_both_lines(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}]
    )
    with pytest.raises(BadInputError) as info:
        list(PromptReader(path))
    assert info.value.line == 3 and info.value.kind == "duplicate_id"
    assert "line 1" in str(info.value)


def test_reader_collapses_identical_hashed_rows_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "x"}\n\n{"prompt": "x"}\n{"prompt": "y"}\n')
    reader = PromptReader(path)
    rows = list(reader)
    assert [r.line for r in rows] == [1, 4]
    assert reader.stats.collapsed_duplicates == 1


def test_reader_sets_bad_rows_aside_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "x"}\nnot json\n{"id": 1, "prompt": "y"}\n{"id": 1, "prompt": "z"}\n')
    bad: list[BadInputError] = []
    rows = list(PromptReader(path, on_bad=bad.append))
    assert [r.line for r in rows] == [1, 3]
    assert [(b.line, b.kind) for b in bad] == [(2, "invalid_json"), (4, "duplicate_id")]


def test_empty_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"\n\n")
    with pytest.raises(UsageError, match="no rows"):
        list(PromptReader(path))
