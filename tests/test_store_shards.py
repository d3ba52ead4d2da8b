"""ShardStore and the durable helpers: what a process death, two old writers or odd ids leave (review 2026-12)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.store.durable import sweep_temp_files, write_atomic
from eagle_datagen.store.logs import JsonlLog
from eagle_datagen.store.shards import OpenReport, ShardInfo, ShardStore, file_sha256


def line(rid: str) -> bytes:
    return orjson.dumps({"id": rid, "x": 1}) + b"\n"


def ids_in(directory: Path) -> list[str]:
    out = []
    for path in sorted(directory.glob("shard_*.jsonl*")):
        out += [orjson.loads(x)["id"] for x in path.read_bytes().splitlines()]
    return out


def opened(
    directory: Path, shard_size: int, known: dict[str, ShardInfo] | None = None
) -> tuple[ShardStore, OpenReport, list[ShardInfo]]:
    """A store opened on ``directory``, what open found, and the shards it finalizes from now on."""
    infos: list[ShardInfo] = []
    store = ShardStore(directory, shard_size, infos.append)
    return store, store.open(known or {}), infos


# --- D1: a .partial below finalized shards (what two writers left) is adopted, never wedged ---------------


def test_a_partial_below_finalized_shards_keeps_its_index_and_finalizes(tmp_path: Path) -> None:
    (tmp_path / "shard_00000.jsonl.partial").write_bytes(line("a"))
    (tmp_path / "shard_00001.jsonl").write_bytes(line("b") + line("c"))
    store, report, infos = opened(tmp_path, 2)
    assert report.adopted == ["shard_00000.jsonl.partial"]
    store.append("d", line("d"))  # fills the partial: finalized under its own name (it wedged here before)
    store.append("e", line("e"))  # the next partial goes above every shard present
    store.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "shard_00000.ids", "shard_00000.jsonl", "shard_00001.ids", "shard_00001.jsonl", "shard_00002.jsonl.partial"
    ]  # fmt: skip
    assert ids_in(tmp_path) == ["a", "d", "b", "c", "e"]
    assert [i.name for i in infos] == ["shard_00000.jsonl"]


def test_a_partial_sharing_a_finalized_name_is_renumbered_and_loses_only_duplicates(tmp_path: Path) -> None:
    (tmp_path / "shard_00000.jsonl").write_bytes(line("a") + line("b"))
    (tmp_path / "shard_00000.jsonl.partial").write_bytes(line("b") + line("c") + line("a") + line("d"))
    (tmp_path / "shard_00001.jsonl.partial").write_bytes(line("e") + b'{"id":"tor')
    store, report, infos = opened(tmp_path, 10)
    assert report.adopted[0] == "shard_00000.jsonl.partial → shard_00002.jsonl.partial"
    assert report.duplicates_dropped == 2 and report.truncated_lines == 1
    assert store.done == {"a", "b", "c", "d", "e"}
    store.append("f", line("f"))
    store.finish()
    ids = ids_in(tmp_path)
    assert sorted(ids) == ["a", "b", "c", "d", "e", "f"] and len(ids) == len(set(ids))
    assert not list(tmp_path.glob("*.partial"))
    for info in infos:
        assert file_sha256(tmp_path / info.name) == info.sha256
    again, report, _ = opened(tmp_path, 10, {i.name: i for i in infos})
    assert again.done == set(ids) and not report.adopted


# --- D22: the .ids sidecar is split on "\n" only ------------------------------------------------------------


def test_ids_holding_unicode_line_separators_keep_the_sidecar_fast_path(tmp_path: Path) -> None:
    odd = ["plain", "line\u2028sep", "para\u2029sep", "nel\x85x", "vt\x0bff\x0cfs\x1cgs\x1drs\x1e"]
    store, _, infos = opened(tmp_path, len(odd))
    for rid in odd:
        store.append(rid, line(rid))
    known = {i.name: i for i in infos}
    again, report, _ = opened(tmp_path, len(odd), known)
    assert report.rebuilt == []  # the sidecar was trusted, the shard not re-read
    assert again.done == set(odd)


def test_a_sidecar_that_disagrees_is_rebuilt_from_the_shard(tmp_path: Path) -> None:
    store, _, infos = opened(tmp_path, 2)
    store.append("a", line("a"))
    store.append("b", line("b"))
    known = {i.name: i for i in infos}
    (tmp_path / "shard_00000.ids").write_bytes(b"a\nb")  # not a whole sidecar
    again, report, _ = opened(tmp_path, 2, known)
    assert report.rebuilt == ["shard_00000.jsonl"] and again.done == {"a", "b"}


# --- D23: stale temp files of write_atomic are swept on open ------------------------------------------------


def test_stale_temp_files_are_swept_on_open(tmp_path: Path) -> None:
    (tmp_path / ".shard_00000.ids.k3j_x9a1.tmp").write_bytes(b"half")  # tempfile.mkstemp's name (0.1)
    (tmp_path / ".shard_00001.ids.0a1b2c3d.tmp").write_bytes(b"half")  # write_atomic's name
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    _, report, _ = opened(tmp_path, 2)
    assert report.swept == [".shard_00000.ids.k3j_x9a1.tmp", ".shard_00001.ids.0a1b2c3d.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]
    assert sweep_temp_files(tmp_path / "missing") == []


# --- D2: every accepted record reaches the kernel when it is accepted ----------------------------------------

_KILLED_CHILD = """
import os, sys
from pathlib import Path
from eagle_datagen.store.shards import ShardStore
store = ShardStore(Path(sys.argv[1]), 1000, lambda info: None)
store.open({})
for i in range(int(sys.argv[2])):
    store.append(f"r{i}", b'{"id":"r%d","x":1}\\n' % i)
os.kill(os.getpid(), 9)  # kill -9 with no checkpoint, no close
"""


def test_records_appended_survive_kill_9_without_a_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tmp_path), "25"], env=env, check=False)
    assert child.returncode == -9
    assert ids_in(tmp_path) == [f"r{i}" for i in range(25)]


def test_a_failed_write_leaves_whole_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle_datagen.errors import OutputWriteError
    from eagle_datagen.store import shards

    store, _, _ = opened(tmp_path, 100)
    store.append("a", line("a"))
    real_write = os.write

    def short_then_full(fd: int, data: Any) -> int:
        real_write(fd, bytes(data)[:5])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards.os, "write", short_then_full)
    with pytest.raises(OutputWriteError, match="the disk is full"):
        store.append("b", line("b"))
    monkeypatch.undo()
    assert (tmp_path / "shard_00000.jsonl.partial").read_bytes() == line("a")
    log = JsonlLog(tmp_path / "failures.jsonl")
    log.append({"id": "x"})
    monkeypatch.setattr(shards.os, "write", short_then_full)
    with pytest.raises(OutputWriteError):
        log.append({"id": "y"})
    monkeypatch.undo()
    log.append({"id": "z"})
    log.close()
    assert [orjson.loads(x)["id"] for x in (tmp_path / "failures.jsonl").read_bytes().splitlines()] == ["x", "z"]


# --- D18: every file we write honours the umask ---------------------------------------------------------------


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_write_atomic_gives_the_umask_mode(tmp_path: Path, umask_027: None) -> None:
    target = tmp_path / "manifest.json"
    write_atomic(target, b"{}")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    target.chmod(0o600)  # a file made by 0.1 (mkstemp's 0600) gets the umask's mode on the next save
    write_atomic(target, b"{}")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_every_file_of_a_run_honours_the_umask(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, umask_027: None
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(12))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
         "--server-url", fake_server.url, "--no-progress", "--shard-size", "5", "--max-new-tokens", "8"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    files = sorted(p for p in out.rglob("*") if p.is_file())
    names = {p.relative_to(out).as_posix() for p in files}
    assert {".lock", "manifest.json", "failures.jsonl", "rejects.jsonl", "shards/shard_00000.ids"} <= names
    assert {p.relative_to(out).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {
        name: oct(0o640) for name in names
    }
