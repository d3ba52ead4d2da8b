"""``--partition I/N`` and ``eagle-datagen merge``: N jobs cover the prompts once, and merge proves it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.inputs.partition import Partition, partition_of
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.verify.merge import merge_runs
from eagle_datagen.verify.verify import verify

#: What a fake run cannot get right (the fake draws think ids at random); everything else must be clean.
FAKE_ARTIFACTS = {"think_structure", "think_unclosed"}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_partition(prompts: Path, out: Path, tokenizer: Path, server: Any, spec: str | None, *extra: str) -> Any:
    args = ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer)]
    args += ["--server-url", server.url, "--no-progress", "--max-new-tokens", "16", "--shard-size", "7", *extra]
    if spec is not None:
        args += ["--partition", spec]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize("text", ["3/2", "0/0", "2/2", "a/b", "1", "-1/3", "1/2/3", ""])
def test_bad_partition_specs_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="--partition"):
        Partition.parse(text)


def test_bad_partition_on_the_command_line_exits_2(tmp_path: Path, tiny_tokenizer: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--tokenizer", str(tiny_tokenizer),
         "--server-url", "http://127.0.0.1:9", "--partition", "3/2"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--partition '3/2'" in result.output and "below N" in result.output


def test_partitions_split_every_key_exactly_once_and_stably(tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(400))
    keys = [row.key for row in PromptReader(prompts)]
    owned = [[row.key for row in PromptReader(prompts, partition=Partition(i, 4))] for i in range(4)]
    assert sorted(k for part in owned for k in part) == sorted(keys)
    assert all(40 < len(part) < 160 for part in owned)  # roughly even
    # The split depends on the key alone: reversing the file keeps every key in its partition.
    reversed_prompts = write_jsonl(tmp_path / "r.jsonl", list(reversed(varied_rows(400))))
    again = [row.key for row in PromptReader(reversed_prompts, partition=Partition(2, 4))]
    assert sorted(again) == sorted(owned[2])
    assert all(partition_of(k, 4) == 2 for k in again)


def test_a_bad_row_is_reported_by_every_partition(tmp_path: Path) -> None:
    rows: list[Any] = [{"id": f"k{i}", "prompt": "x"} for i in range(20)]
    rows.insert(5, {"id": "bad", "messages": "not a list"})
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    for index in range(3):
        with pytest.raises(Exception, match=r"p\.jsonl:6: 'messages' must be a list"):
            list(PromptReader(prompts, partition=Partition(index, 3)))


@pytest.fixture
def array_of_three(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> tuple[Path, list[Path]]:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(60))
    outs = [tmp_path / f"part-{i}" for i in range(3)]
    for i, out in enumerate(outs):
        run_partition(prompts, out, tiny_tokenizer, fake_server, f"{i}/3", "--samples-per-prompt", "2")
    return prompts, outs


def test_three_partitions_merge_into_the_records_of_one_run(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, array_of_three: tuple[Path, list[Path]]
) -> None:
    prompts, outs = array_of_three
    single = tmp_path / "single"
    run_partition(prompts, single, tiny_tokenizer, fake_server, None, "--samples-per-prompt", "2")

    manifests = [orjson.loads((o / "manifest.json").read_bytes()) for o in outs]
    assert [m["plan"]["partition"]["index"] for m in manifests] == [0, 1, 2]
    per_part = [{r["id"] for r in read_records(o)} for o in outs]
    assert not (per_part[0] & per_part[1]) and not (per_part[1] & per_part[2]) and not (per_part[0] & per_part[2])

    merged = tmp_path / "all"
    result = invoke("merge", str(merged), *map(str, reversed(outs)))
    assert result.exit_code == 0, result.output
    assert "merged 3 partitions" in result.output and "120 records" in result.output
    assert f"eagle-datagen verify-shard {merged}" in result.output

    by_id = {r["id"]: r for r in read_records(single)}
    merged_records = read_records(merged)
    assert len(merged_records) == 120 == len(by_id)
    assert {r["id"]: r for r in merged_records} == by_id  # same ids, same bytes (timing stamps aside)
    assert all((merged / "shards" / p.name).is_symlink() for p in (merged / "shards").glob("*.jsonl"))

    report = verify([merged])
    assert set(report.errors) <= FAKE_ARTIFACTS, report.to_json()["errors"]
    assert report.records == 120
    manifest = orjson.loads((merged / "manifest.json").read_bytes())
    assert "partition" not in manifest["plan"]
    assert [r["partition"] for r in manifest["runs"]] == ["0/3", "1/3", "2/3"]


def test_copy_makes_an_independent_directory(tmp_path: Path, array_of_three: tuple[Path, list[Path]]) -> None:
    _, outs = array_of_three
    merged = tmp_path / "copied"
    merge_runs(merged, outs, copy=True)
    for out in outs:
        shutil.rmtree(out)
    report = verify([merged], rerender=False)
    assert set(report.errors) <= FAKE_ARTIFACTS, report.to_json()["errors"]


def test_merge_refuses_a_missing_partition(tmp_path: Path, array_of_three: tuple[Path, list[Path]]) -> None:
    _, outs = array_of_three
    with pytest.raises(UsageError, match=r"1 of 3 partitions are missing: 1/3"):
        merge_runs(tmp_path / "m", [outs[0], outs[2]])
    assert not (tmp_path / "m").exists()


def test_merge_refuses_a_repeated_partition(tmp_path: Path, array_of_three: tuple[Path, list[Path]]) -> None:
    _, outs = array_of_three
    twin = tmp_path / "twin"
    shutil.copytree(outs[1], twin, symlinks=True)
    with pytest.raises(UsageError, match=r"partition 1/3 appears twice"):
        merge_runs(tmp_path / "m", [*outs, twin])


def test_merge_refuses_missing_records_with_counts_and_examples(
    tmp_path: Path, array_of_three: tuple[Path, list[Path]]
) -> None:
    _, outs = array_of_three
    manifest_path = outs[2] / "manifest.json"
    manifest = orjson.loads(manifest_path.read_bytes())
    dropped = manifest["shards"].pop()
    manifest_path.write_bytes(orjson.dumps(manifest))
    with pytest.raises(UsageError) as caught:
        merge_runs(tmp_path / "m", outs)
    message = str(caught.value)
    assert f"{dropped['records']} of 120 records are missing" in message
    assert "e.g. '" in message and str(outs[2]) in message


def test_merge_refuses_runs_of_another_plan(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, array_of_three: tuple[Path, list[Path]]
) -> None:
    prompts, outs = array_of_three
    other = tmp_path / "other-1"
    run_partition(
        prompts, other, tiny_tokenizer, fake_server, "1/3", "--samples-per-prompt", "2", "--temperature", "0.5"
    )
    with pytest.raises(UsageError, match=r"another plan .* sampling_params"):
        merge_runs(tmp_path / "m", [outs[0], other, outs[2]])


def test_merge_refuses_overlapping_records(tmp_path: Path, array_of_three: tuple[Path, list[Path]]) -> None:
    _, outs = array_of_three
    # Splice one of partition 0's shards into partition 1's manifest and directory.
    m0 = orjson.loads((outs[0] / "manifest.json").read_bytes())
    m1 = orjson.loads((outs[1] / "manifest.json").read_bytes())
    stolen = m0["shards"][0]
    name = "shard_09999.jsonl"
    shutil.copyfile(outs[0] / "shards" / stolen["name"], outs[1] / "shards" / name)
    m1["shards"].append({**stolen, "name": name})
    (outs[1] / "manifest.json").write_bytes(orjson.dumps(m1))
    with pytest.raises(UsageError, match=r"the partitions overlap: \d+ record ids in two runs"):
        merge_runs(tmp_path / "m", outs)


def test_merge_refuses_an_unfinished_or_unpartitioned_run(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, array_of_three: tuple[Path, list[Path]]
) -> None:
    prompts, outs = array_of_three
    (outs[1] / "shards" / "shard_00099.jsonl.partial").write_bytes(b"")
    with pytest.raises(UsageError, match=rf"not finished .* eagle-datagen resume --out {outs[1]}"):
        merge_runs(tmp_path / "m", outs)
    single = tmp_path / "single"
    run_partition(prompts, single, tiny_tokenizer, fake_server, None)
    with pytest.raises(UsageError, match="not a partitioned run"):
        merge_runs(tmp_path / "m", [single])


def test_resume_keeps_the_partition(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(40))
    out = tmp_path / "o"
    run_partition(prompts, out, tiny_tokenizer, fake_server, "1/2")
    first = {r["id"] for r in read_records(out)}
    result = invoke("resume", "--out", str(out), "--no-progress")
    assert result.exit_code == 0, result.output
    assert {r["id"] for r in read_records(out)} == first
    assert all(partition_of(rid, 2) == 1 for rid in first)


def test_merge_refuses_a_run_with_a_live_writer(tmp_path: Path, array_of_three: tuple[Path, list[Path]]) -> None:
    from eagle_datagen.store.lock import hold

    _, outs = array_of_three
    with hold(outs[1], "eagle-datagen resume"), pytest.raises(UsageError, match=rf"{outs[1]} is in use by pid"):
        merge_runs(tmp_path / "m", outs)
    assert merge_runs(tmp_path / "m", outs).records == 120  # once the writer is gone


def test_merge_reads_a_shard_whose_ids_sidecar_is_torn(tmp_path: Path, array_of_three: tuple[Path, list[Path]]) -> None:
    _, outs = array_of_three
    sidecar = next((outs[0] / "shards").glob("*.ids"))
    sidecar.write_bytes(sidecar.read_bytes()[:-5])  # cut mid-id: not a whole sidecar
    assert merge_runs(tmp_path / "m", outs).records == 120
