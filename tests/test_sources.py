"""Prompt sources: compressed JSONL, Parquet (file or directory) and save_to_disk datasets read as the same rows."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.inputs.sources import Columns, open_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def rows_of(path: Path, **kwargs: Any) -> list[tuple[str, list[Any], Any]]:
    return [(r.key, r.messages, r.tools) for r in PromptReader(path, **kwargs)]


def table_rows(n: int) -> list[dict[str, Any]]:
    """varied_rows, as a table can hold them: one column per shape, tools as a JSON string, ids as strings."""
    out = []
    for row in varied_rows(n):
        item: dict[str, Any] = {
            "id": None if row.get("id") is None else str(row["id"]),
            "messages": orjson.dumps(row["messages"]).decode() if "messages" in row else None,
            "conversations": row.get("conversations"),
            "prompt": row.get("prompt"),
            "tools": orjson.dumps(row["tools"]).decode() if "tools" in row else None,
        }
        out.append(item)
    return out


def test_gzip_and_zstd_jsonl_give_the_rows_of_the_plain_file(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    plain = write_jsonl(tmp_path / "p.jsonl", varied_rows(50))
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    zst = tmp_path / "p.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    expected = rows_of(plain)
    assert rows_of(gz) == expected
    assert rows_of(zst) == expected
    identity = open_source(gz).identity()
    assert identity["kind"] == "jsonl.gz" and identity["lines"] == 50
    assert identity["files"][0]["hashed"] == "whole file"


def test_plain_jsonl_identity_keeps_the_0_1_form(tmp_path: Path) -> None:
    plain = write_jsonl(tmp_path / "p.jsonl", varied_rows(3))
    assert set(open_source(plain).identity()) == {"path", "size", "sha256", "lines"}


def test_parquet_file_and_directory(tmp_path: Path) -> None:
    rows = table_rows(40)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "one.parquet", row_group_size=7)
    shard_dir = tmp_path / "parts"
    shard_dir.mkdir()
    pq.write_table(table.slice(0, 25), shard_dir / "part-0.parquet")
    pq.write_table(table.slice(25), shard_dir / "part-1.parquet")

    plain = rows_of(write_jsonl(tmp_path / "p.jsonl", varied_rows(40)))
    assert rows_of(tmp_path / "one.parquet") == plain
    assert rows_of(shard_dir) == plain

    identity = open_source(shard_dir).identity()
    assert [f["name"] for f in identity["files"]] == ["part-0.parquet", "part-1.parquet"]
    assert [f["rows"] for f in identity["files"]] == [25, 15]
    assert identity["files"][0]["hashed"] == "parquet footer + size"
    # The pin changes when the data changes.
    pq.write_table(table.slice(1, 24), shard_dir / "part-0.parquet")
    assert open_source(shard_dir).identity()["files"][0]["sha256"] != identity["files"][0]["sha256"]


def test_save_to_disk_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"id": f"q{i}", "question": f"what is {i}?"} for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got = rows_of(tmp_path / "ds", columns=Columns(prompt="question"))
    assert got == [(f"q{i}", [{"role": "user", "content": f"what is {i}?"}], None) for i in range(30)]
    assert open_source(tmp_path / "ds", Columns(prompt="question")).identity()["kind"] == "arrow"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UsageError, match=r"DatasetDict with splits \['train'\].*--prompts .*dd/train"):
        open_source(tmp_path / "dd")


def test_unknown_columns_are_named(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "t.parquet")
    with pytest.raises(
        UsageError, match=r"t\.parquet has none of the columns .* its columns are \['question', 'answer'\]"
    ):
        open_source(tmp_path / "t.parquet")
    with pytest.raises(UsageError, match=r"no column 'text'; its columns are \['question', 'answer'\]"):
        open_source(tmp_path / "t.parquet", Columns(prompt="text"))
    assert rows_of(tmp_path / "t.parquet", columns=Columns(prompt="question"))[0][1] == [
        {"role": "user", "content": "q"}
    ]


def test_a_bad_parquet_row_names_file_and_row(tmp_path: Path) -> None:
    rows = [{"messages": orjson.dumps([{"role": "user", "content": "hi"}]).decode()} for _ in range(5)]
    rows[3] = {"messages": orjson.dumps([{"role": "robot", "content": "hi"}]).decode()}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(BadInputError) as caught:
        list(PromptReader(path))
    assert str(caught.value).startswith(f"{path}:4: messages[0] has role 'robot'")
    seen: list[BadInputError] = []
    assert len(list(PromptReader(path, on_bad=seen.append))) == 1  # identical hashed rows collapse
    assert [e.line for e in seen] == [4]


def test_a_mixed_directory_and_an_unknown_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "x"}])
    pq.write_table(pa.Table.from_pylist([{"prompt": "y"}]), tmp_path / "d" / "b.parquet")
    with pytest.raises(UsageError, match="mixes jsonl, parquet files"):
        open_source(tmp_path / "d")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UsageError, match="unknown file type"):
        open_source(tmp_path / "x.csv")


def test_run_from_parquet_matches_run_from_jsonl(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    write_jsonl(tmp_path / "p.jsonl", varied_rows(30))
    pq.write_table(pa.Table.from_pylist(table_rows(30)), tmp_path / "p.parquet")
    for name in ("p.jsonl", "p.parquet"):
        result = CliRunner().invoke(
            main,
            ["run", "--prompts", str(tmp_path / name), "--out", str(tmp_path / f"out-{name}"),
             "--tokenizer", str(tiny_tokenizer), "--server-url", fake_server.url, "--no-progress",
             "--max-new-tokens", "8"],
            catch_exceptions=False,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
    a = {r["id"]: r for r in read_records(tmp_path / "out-p.jsonl")}
    b = {r["id"]: r for r in read_records(tmp_path / "out-p.parquet")}
    assert a == b and len(a) == 30
    plan = orjson.loads((tmp_path / "out-p.parquet" / "manifest.json").read_bytes())["plan"]
    assert plan["prompts"]["kind"] == "parquet" and plan["prompts"]["lines"] == 30


def test_verify_rerenders_a_parquet_run_and_notices_a_changed_input(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    from eagle_datagen.verify.verify import verify

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(table_rows(24)), path)
    out = tmp_path / "o"
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(path), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
         "--server-url", fake_server.url, "--no-progress", "--max-new-tokens", "8"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = verify([out])
    assert not [s for s in report.not_checked if "re-render" in s], report.not_checked
    assert "prompt_mismatch" not in report.errors and "prompts_changed" not in report.warnings
    # The same rows in another order: another input, and verify says so (the records still match their rows).
    pq.write_table(pa.Table.from_pylist(list(reversed(table_rows(24)))), path)
    again = verify([out])
    assert "prompts_changed" in again.warnings and "prompt_mismatch" not in again.errors
    # A row whose text changed is a prompt mismatch.
    rows = table_rows(24)
    rows[0]["prompt"] = "something else entirely"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert verify([out]).errors["prompt_mismatch"] == 1
