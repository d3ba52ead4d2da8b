"""``eagle-datagen export``: rows, masks, options, refusals, export.json (dev venv: no torch needed).

The trainers' own loaders read our files in tests/test_export_trainers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.export.deps import need
from eagle_datagen.export.rows import TrainRow, merge_turns, segments_from, single_row
from eagle_datagen.export.source import parse_record, plan_sha256
from eagle_datagen.store.manifest import Manifest
from export_data import EOS, expected_rows, make_run, single_records, turn_records


def run_export(directory: Path, out: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["export", str(directory), "--out", str(out), "--no-progress", *args])
    return result


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def pairs(rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    return [(r["input_ids"], r["loss_mask"]) for r in rows]


@pytest.fixture
def run(tmp_path: Path) -> Any:
    return make_run(tmp_path, single_records(21), shard_size=8)


# --- the rows ----------------------------------------------------------------------------------------


def test_specforge_rows_are_prompt_plus_output_with_the_mask_at_the_boundary(run: Any, tmp_path: Path) -> None:
    result = run_export(run.out, tmp_path / "sf", "--format", "specforge")
    assert result.exit_code == 0, result.output
    rows = jsonl_rows(tmp_path / "sf" / "train.jsonl")
    assert pairs(rows) == expected_rows(run.records)
    assert all(set(r) == {"input_ids", "loss_mask"} for r in rows)
    stop_rows = [r for r, rec in zip(rows, run.records, strict=True) if rec["finish_reason"]["type"] == "stop"]
    assert stop_rows and all(r["input_ids"][-1] == EOS and r["loss_mask"][-1] == 1 for r in stop_rows)
    first = run.records[0]
    boundary = len(first["prompt_ids"])
    assert rows[0]["loss_mask"][boundary - 1 : boundary + 1] == [0, 1]
    assert "exported 21 rows" in result.output and "left out: none" in result.output


def test_speculators_rows_carry_id_and_uniform_metadata(run: Any, tmp_path: Path) -> None:
    result = run_export(run.out, tmp_path / "sp", "--format", "speculators")
    assert result.exit_code == 0, result.output
    rows = jsonl_rows(tmp_path / "sp" / "train.jsonl")
    assert pairs(rows) == expected_rows(run.records)
    assert [r["id"] for r in rows] == [r["id"] for r in run.records]
    assert {tuple(r["metadata"]) for r in rows} == {
        ("key", "sample", "finish_reason", "prompt_len", "conversation", "turn", "turns")
    }
    assert [r["metadata"]["prompt_len"] for r in rows] == [len(r["prompt_ids"]) for r in run.records]
    assert [r["metadata"]["finish_reason"] for r in rows] == [r["finish_reason"]["type"] for r in run.records]


def test_parquet_columns_and_plan_metadata_load_with_datasets(run: Any, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    result = run_export(run.out, tmp_path / "pq", "--format", "parquet")
    assert result.exit_code == 0, result.output
    path = tmp_path / "pq" / "train.parquet"
    metadata = pq.read_schema(path).metadata
    plan = Manifest.load(run.out).plan
    assert orjson.loads(metadata[b"eagle_datagen.plan"]) == plan
    assert metadata[b"eagle_datagen.plan_sha256"].decode() == plan_sha256(plan)
    loaded = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "c"))
    assert loaded.column_names == [
        "id",
        "input_ids",
        "loss_mask",
        "prompt_len",
        "finish_reason",
        "conversation",
        "turn",
    ]
    assert list(zip(loaded["input_ids"], loaded["loss_mask"], strict=True)) == expected_rows(run.records)
    assert loaded["prompt_len"] == [len(r["prompt_ids"]) for r in run.records]
    assert set(loaded["conversation"]) == {None}


def test_export_json_ties_the_export_to_the_plan_and_counts_everything(run: Any, tmp_path: Path) -> None:
    result = run_export(run.out, tmp_path / "sf", "--format", "specforge", "--include-finish", "stop")
    assert result.exit_code == 0, result.output
    info = orjson.loads((tmp_path / "sf" / "export.json").read_bytes())
    assert info["source"]["plan_sha256"] == plan_sha256(Manifest.load(run.out).plan)
    assert [s["name"] for s in info["source"]["shards"]] == [
        "shard_00000.jsonl",
        "shard_00001.jsonl",
        "shard_00002.jsonl",
    ]
    lengths = sum(r["finish_reason"]["type"] == "length" for r in run.records)
    assert info["counts"]["records_read"] == 21
    assert info["counts"]["rows_written"] == 21 - lengths
    assert info["counts"]["left_out"] == {"finish_length": lengths}
    assert info["options"]["include_finish"] == ["stop"]
    assert f"finish_length {lengths}" in result.output
    kept = [r for r in run.records if r["finish_reason"]["type"] == "stop"]
    assert pairs(jsonl_rows(tmp_path / "sf" / "train.jsonl")) == expected_rows(kept)


def test_max_length_cut_and_drop_are_counted(run: Any, tmp_path: Path) -> None:
    limit = 20
    over = [r for r in run.records if len(r["prompt_ids"]) + len(r["output_ids"]) > limit]
    no_output = [r for r in over if len(r["prompt_ids"]) >= limit]
    assert over and len(no_output) < len(over)
    result = run_export(run.out, tmp_path / "cut", "--format", "specforge", "--max-length", str(limit))
    assert result.exit_code == 0, result.output
    info = orjson.loads((tmp_path / "cut" / "export.json").read_bytes())["counts"]
    assert info["cut_rows"] == len(over) - len(no_output)
    assert info["left_out"] == ({"max_length_no_output": len(no_output)} if no_output else {})
    expected = [(ids[:limit], mask[:limit]) for ids, mask in expected_rows(run.records) if 1 in mask[:limit]]
    assert pairs(jsonl_rows(tmp_path / "cut" / "train.jsonl")) == expected
    assert f"{info['cut_rows']} rows cut" in result.output

    result = run_export(
        run.out, tmp_path / "drop", "--format", "specforge", "--max-length", str(limit), "--over-length", "drop"
    )
    assert result.exit_code == 0, result.output
    info = orjson.loads((tmp_path / "drop" / "export.json").read_bytes())["counts"]
    assert info["left_out"] == {"max_length": len(over)} and info["cut_rows"] == 0
    assert pairs(jsonl_rows(tmp_path / "drop" / "train.jsonl")) == expected_rows(
        [r for r in run.records if r not in over]
    )


def test_shuffle_is_seeded_and_loses_nothing(run: Any, tmp_path: Path) -> None:
    outs = []
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        result = run_export(run.out, tmp_path / name, "--format", "speculators", "--shuffle-seed", seed)
        assert result.exit_code == 0, result.output
        outs.append([r["id"] for r in jsonl_rows(tmp_path / name / "train.jsonl")])
    ids = [r["id"] for r in run.records]
    assert outs[0] == outs[1] != ids and outs[2] != outs[0]
    assert sorted(outs[0]) == sorted(ids) == sorted(outs[2])
    by_id = {r["id"]: r for r in jsonl_rows(tmp_path / "a" / "train.jsonl")}
    assert [(by_id[i]["input_ids"], by_id[i]["loss_mask"]) for i in ids] == expected_rows(run.records)


# --- turns -------------------------------------------------------------------------------------------


def test_turn_records_export_one_row_per_turn_by_default(tmp_path: Path) -> None:
    records = turn_records(4, 3)
    run = make_run(tmp_path, records, samples=None)
    result = run_export(run.out, tmp_path / "sp", "--format", "speculators")
    assert result.exit_code == 0, result.output
    rows = jsonl_rows(tmp_path / "sp" / "train.jsonl")
    assert pairs(rows) == expected_rows(records)
    assert [(r["metadata"]["conversation"], r["metadata"]["turn"]) for r in rows] == [
        (r["conversation"], r["turn"]) for r in records
    ]


def test_merge_turns_one_row_per_conversation_or_counted_fallback(tmp_path: Path) -> None:
    records = turn_records(5, 3, rewrite={"c2"})
    records = [r for r in records if r["id"] != "c4@t2"]  # a missing middle turn
    run = make_run(tmp_path, records, samples=None, shard_size=4)
    result = run_export(run.out, tmp_path / "m", "--format", "speculators", "--merge-turns")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in jsonl_rows(tmp_path / "m" / "train.jsonl")}
    for key in ("c0", "c1", "c3"):
        turns = [r for r in records if r["conversation"] == key]
        last = turns[-1]
        ids = last["prompt_ids"] + last["output_ids"]
        mask = [0] * len(ids)
        for t in turns:  # each turn's output is trained; history and user turns are not
            start = len(t["prompt_ids"])
            mask[start : start + len(t["output_ids"])] = [1] * len(t["output_ids"])
        assert rows[key]["input_ids"] == ids and rows[key]["loss_mask"] == mask
        assert rows[key]["metadata"]["turns"] == 3
    per_turn = [r for r in records if r["conversation"] in {"c2", "c4"}]
    assert [(rows[r["id"]]["input_ids"], rows[r["id"]]["loss_mask"]) for r in per_turn] == expected_rows(per_turn)
    assert len(rows) == 3 + len(per_turn)
    info = orjson.loads((tmp_path / "m" / "export.json").read_bytes())["counts"]
    assert info["merged_conversations"] == 3 and info["merged_records"] == 9
    assert info["merge_fallback_conversations"] == {"history_changed": 1, "missing_turn": 1}
    assert "kept as one row per turn: 2 (history_changed 1, missing_turn 1)" in result.output


def test_merge_turns_unit() -> None:
    records = [parse_record(orjson.dumps(r)) for r in turn_records(1, 2)]
    row, reason = merge_turns(list(reversed(records)))
    assert reason is None and row is not None and row.id == "c0" and row.turns == 2
    dup, reason = merge_turns([records[0], records[0]])
    assert dup is None and reason == "duplicate_turn"


# --- reading and refusing ------------------------------------------------------------------------------


def test_a_record_verify_rejects_refuses_the_export_or_is_left_out(run: Any, tmp_path: Path) -> None:
    bad = dict(run.records[5], completion_tokens=len(run.records[5]["output_ids"]) + 1)
    broken = make_run(tmp_path, [*run.records[:5], bad, *run.records[6:]], name="broken")
    result = run_export(broken.out, tmp_path / "x", "--format", "specforge")
    assert result.exit_code == 1
    assert "nothing was exported" in result.output and "completion_tokens: 1" in result.output
    assert "shard_00000.jsonl:6" in result.output and "--skip-invalid" in result.output
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))

    result = run_export(broken.out, tmp_path / "y", "--format", "specforge", "--skip-invalid")
    assert result.exit_code == 0, result.output
    info = orjson.loads((tmp_path / "y" / "export.json").read_bytes())
    assert info["counts"]["left_out"] == {"invalid_completion_tokens": 1}
    assert info["verify"]["errors"] == {"completion_tokens": 1}
    kept = [r for i, r in enumerate(run.records) if i != 5]
    assert pairs(jsonl_rows(tmp_path / "y" / "train.jsonl")) == expected_rows(kept)


def test_a_changed_shard_is_refused_with_the_checksum_finding(run: Any, tmp_path: Path) -> None:
    shard = run.out / "shards" / "shard_00001.jsonl"
    shard.write_bytes(
        shard.read_bytes() + orjson.dumps(single_records(1, seed=9)[0] | {"id": "extra", "key": "extra"}) + b"\n"
    )
    result = run_export(run.out, tmp_path / "x", "--format", "specforge")
    assert result.exit_code == 1 and "shard_checksum" in result.output and "shard_count" in result.output
    result = run_export(run.out, tmp_path / "y", "--format", "specforge", "--skip-invalid")
    assert result.exit_code == 0 and "beyond single records" in result.output


def test_a_live_writer_is_refused(run: Any, tmp_path: Path) -> None:
    from eagle_datagen.store.lock import hold

    with hold(run.out, "eagle-datagen run"):  # the writer's own lock, as `run` holds it
        result = run_export(run.out, tmp_path / "x", "--format", "specforge")
        assert result.exit_code == 2
        assert f"in use by pid {os.getpid()}" in result.output and "finished shards only" in result.output
        assert not (tmp_path / "x").exists()
    result = run_export(run.out, tmp_path / "x", "--format", "specforge")  # released: the .lock file stays
    assert result.exit_code == 0, result.output
    assert (run.out / ".lock").exists()


def test_a_partial_shard_is_not_read_and_says_so(tmp_path: Path) -> None:
    run = make_run(tmp_path, single_records(11), shard_size=8, finish=False)
    assert (run.out / "shards" / "shard_00001.jsonl.partial").is_file()
    result = run_export(run.out, tmp_path / "x", "--format", "specforge")
    assert result.exit_code == 0, result.output
    assert "not read: 3 records in shard_00001.jsonl.partial" in result.output
    assert f"eagle-datagen resume --out {run.out}" in result.output
    assert pairs(jsonl_rows(tmp_path / "x" / "train.jsonl")) == expected_rows(run.records[:8])
    assert orjson.loads((tmp_path / "x" / "export.json").read_bytes())["source"]["partial_records_not_read"] == 3


def test_bad_directories_and_outputs_are_refused(run: Any, tmp_path: Path) -> None:
    result = run_export(run.out / "shards", tmp_path / "x", "--format", "specforge")
    assert result.exit_code == 2 and "no manifest.json" in result.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    result = run_export(run.out, tmp_path / "full", "--format", "specforge")
    assert result.exit_code == 2 and "not an empty directory" in result.output
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert run_export(run.out, tmp_path / "empty", "--format", "specforge").exit_code == 0
    result = run_export(run.out, tmp_path / "z", "--format", "specforge", "--include-finish", "stop,abort")
    assert result.exit_code == 2 and "subset of stop,length" in result.output


def test_records_in_another_json_layout_give_the_same_row() -> None:
    record = single_records(1)[0] | {"conversation": "c", "turn": 2}
    compact = parse_record(orjson.dumps(record))
    spaced = parse_record(orjson.dumps(record, option=orjson.OPT_INDENT_2).replace(b"\n", b" ") + b"\n")
    reordered = parse_record(orjson.dumps(dict(reversed(list(record.items())))))
    for other in (spaced, reordered):
        assert other == compact
    assert compact.turn == 2 and compact.conversation == "c" and compact.finish == "stop"
    row = single_row(compact)
    assert (row.ids(), row.mask()) == expected_rows([record])[0]
    assert orjson.loads(row.mask_json()) == row.mask()


def test_segments_round_trip() -> None:
    ids, mask = [5, 6, 7, 8, 9], [0, 1, 1, 0, 1]
    row = TrainRow("r", "r", 0, segments_from(ids, mask), "stop", None, None)
    assert (row.ids(), row.mask(), row.prompt_len, row.loss_tokens) == (ids, mask, 1, 3)
    assert row.trained_ids() == [6, 7, 9]


def test_a_missing_optional_dependency_names_the_extra() -> None:
    with pytest.raises(UsageError, match=r"pip install 'eagle-datagen\[export\]'"):
        need("eagle_datagen_no_such_module", "--format parquet")


def test_help_imports_no_optional_dependency() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from eagle_datagen.cli import main; "
        "r = CliRunner().invoke(main, ['export', '--help']); assert r.exit_code == 0, r.output; "
        "r = CliRunner().invoke(main, ['vocab-map', '--help']); assert r.exit_code == 0, r.output; "
        "bad = [m for m in ('numpy', 'pyarrow', 'datasets', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_merge_and_shuffle_together_and_turn_columns_in_parquet(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet")
    import pyarrow.parquet as pq

    records = turn_records(8, 2)
    run = make_run(tmp_path, records, samples=None, shard_size=5)
    result = run_export(run.out, tmp_path / "a", "--format", "speculators", "--merge-turns", "--shuffle-seed", "3")
    assert result.exit_code == 0, result.output
    rows = jsonl_rows(tmp_path / "a" / "train.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(f"c{i}" for i in range(8))
    assert [r["id"] for r in rows] != [f"c{i}" for i in range(8)]
    result = run_export(run.out, tmp_path / "p", "--format", "parquet")
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "p" / "train.parquet")
    assert table.column("conversation").to_pylist() == [r["conversation"] for r in records]
    assert table.column("turn").to_pylist() == [r["turn"] for r in records]
    assert table.column("prompt_len").to_pylist() == [len(r["prompt_ids"]) for r in records]


def test_a_killed_exports_staging_is_swept(run: Any, tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".sf.partial-{dead.stdout.strip()}"
    stale.mkdir()
    (stale / "train.jsonl").write_text("half")
    (tmp_path / f".sf.partial-{dead.stdout.strip()}.arrow-tmp").mkdir()
    assert run_export(run.out, tmp_path / "sf", "--format", "specforge").exit_code == 0
    assert not stale.exists() and not list(tmp_path.glob(".sf.partial-*"))


def test_a_real_run_exports_its_records_exactly(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    """`eagle-datagen run` (fake SGLang, Kimi-style thinking template) → export: the records as written, less
    exactly the records verify-shard rejects (the fake samples random ids, so a few open reasoning twice)."""
    from conftest import read_records, varied_rows, write_jsonl
    from eagle_datagen.verify.verify import verify

    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(60))
    out = tmp_path / "data"
    args = ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tiny_tokenizer)]
    args += ["--server-url", fake_server.url, "--no-progress", "--max-new-tokens", "24", "--shard-size", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    records = read_records(out)
    report = verify([out], rerender=False, max_errors=1000)
    rejected = {f.id for findings in report.examples["error"].values() for f in findings}
    refused = run_export(out, tmp_path / "x", "--format", "speculators")
    assert (refused.exit_code == 1) == bool(rejected), refused.output

    result = run_export(out, tmp_path / "sp", "--format", "speculators", "--skip-invalid")
    assert result.exit_code == 0, result.output
    rows = jsonl_rows(tmp_path / "sp" / "train.jsonl")
    kept = [r for r in records if r["id"] not in rejected]
    assert [r["id"] for r in rows] == [r["id"] for r in kept]
    assert pairs(rows) == expected_rows(kept)
    info = orjson.loads((tmp_path / "sp" / "export.json").read_bytes())["counts"]
    assert sum(info["left_out"].values()) == len(rejected)


def test_an_export_with_no_row_left_is_refused(run: Any, tmp_path: Path) -> None:
    result = run_export(run.out, tmp_path / "x", "--format", "specforge", "--max-length", "1", "--over-length", "drop")
    assert result.exit_code == 1 and "no row is left to export from 21 records (max_length 21)" in result.output
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))
