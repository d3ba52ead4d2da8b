"""``eagle-datagen merge OUT RUN_DIR…``: prove that the partitions of a job array cover the prompts once,
then write one run directory that holds them all.

The proof, before anything is written:

* every run is a finished partitioned run (``--partition I/N``): a manifest, no live writer, no unfinished
  ``.partial`` shard;
* the plans agree field by field, apart from the partition (prompts identity, tokenizer, chat-template kwargs,
  sampling, samples per prompt, …);
* the partitions are ``0/N`` … ``(N-1)/N``, each once;
* the record ids are disjoint, each run holds only keys of its own partition, and together they hold every
  record the prompts file asks for (``key`` or ``key#i`` per sample), apart from rows the runs set aside in
  ``rejects.jsonl`` (counted). Failed requests are missing records: the message names the run to resume.

``OUT`` then gets ``manifest.json`` (the common plan without the partition, so ``verify-shard OUT`` and every
other reader see one ordinary run) and ``shards/shard_NNNNN.jsonl`` renumbered in partition order, each a
symbolic link to the partition's shard (``--copy``: a copy), with its ``.ids`` sidecar. Shard counts and
sha256 come from the partitions' manifests.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.errors import UsageError
from eagle_datagen.generate.pipeline import record_ids
from eagle_datagen.inputs.partition import partition_of
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.inputs.sources import Columns
from eagle_datagen.record.turns import split_turn_id
from eagle_datagen.store.lock import check_not_in_use
from eagle_datagen.store.logs import ENDS_NAME, FAILURES_NAME, REJECTS_NAME, read_entries
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest, plan_differences
from eagle_datagen.store.shards import SHARD_RE, ShardInfo, shard_ids, shard_name

SHARDS_DIR = "shards"
EXAMPLES = 5


@dataclass
class MergeReport:
    """What ``merge`` found and wrote."""

    out: Path
    partitions: int
    records: int
    shards: int
    set_aside: int
    copied: bool
    per_run: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "partitions": self.partitions,
            "records": self.records,
            "shards": self.shards,
            "set_aside": self.set_aside,
            "copied": self.copied,
            "runs": self.per_run,
        }


@dataclass
class _Run:
    directory: Path
    manifest: Manifest
    index: int
    count: int


def merge_runs(out: Path, run_dirs: list[Path], *, copy: bool = False, prompts: Path | None = None) -> MergeReport:
    """Checks ``run_dirs`` (see the module docstring) and writes ``out``; raises :class:`UsageError`."""
    if not run_dirs:
        raise UsageError("give the run directories of the partitions to merge")
    runs = [_load_run(d) for d in run_dirs]
    _check_plans(runs)
    runs.sort(key=lambda r: r.index)
    _check_partition_set(runs)
    plan = runs[0].manifest.plan
    samples = int(plan.get("samples_per_prompt", 1))

    owner: dict[str, int] = {}
    overlaps: list[str] = []
    strays: list[str] = []
    for position, run in enumerate(runs):
        for rid in _record_ids(run):
            if rid in owner:
                overlaps.append(f"{rid!r} in {runs[owner[rid]].directory} and {run.directory}")
                continue
            owner[rid] = position
            if _partition_of_record(rid, samples, run.count) != run.index:
                strays.append(f"{rid!r} in {run.directory} (partition {run.index}/{run.count})")
    if overlaps:
        raise UsageError(f"the partitions overlap: {len(overlaps):,} record ids in two runs, e.g. " + _first(overlaps))
    if strays:
        raise UsageError(
            f"{len(strays):,} records are in a run whose partition does not own their key, e.g. " + _first(strays)
        )

    set_aside = _set_aside_keys(runs)
    source = prompts or _plan_prompts(plan)
    expected: set[str] = set()
    missing: list[str] = []
    turns = isinstance(plan.get("turns"), dict)
    ended = _ended_conversations(runs) if turns else set()
    for key in _prompt_keys(source, plan):
        for rid, _ in record_ids(key, samples):
            expected.add(rid)
            # --turns all: a conversation is there once its partition's conversations.jsonl says it ended
            done = rid in ended if turns else rid in owner
            if not done and key not in set_aside:
                missing.append(rid)
    if missing:
        failed = _failed_ids(runs)
        retry = sorted({str(runs[failed[rid]].directory) for rid in missing if rid in failed})
        hint = (
            ("; failed requests: " + "; ".join(f"eagle-datagen resume --out {d}" for d in retry) + " retries them")
            if retry
            else ""
        )
        where = sorted(
            {
                str(r.directory)
                for r in runs
                for m in missing[:1000]
                if _partition_of_record(m, samples, r.count) == r.index
            }
        )
        raise UsageError(
            f"the partitions are incomplete: {len(missing):,} of {len(expected):,} records are missing, e.g. "
            + _first([repr(m) for m in missing])
            + f" (owned by {', '.join(where)}){hint}"
        )
    unknown = [rid for rid in owner if _base_of(rid) not in expected]
    if unknown:
        raise UsageError(
            f"{len(unknown):,} records have ids that {source} does not ask for, e.g. {_first([repr(u) for u in unknown])}; "
            "is this the prompts file of the runs? (its sha256 is pinned in their plans)"
        )
    return _write(out, runs, copy=copy, records=len(owner), set_aside=len(set_aside))


def _load_run(directory: Path) -> _Run:
    manifest = Manifest.load(directory)
    partition = manifest.plan.get("partition")
    if not isinstance(partition, dict):
        raise UsageError(f"{directory} is not a partitioned run (it was started without --partition): nothing to merge")
    _refuse_live_writer(directory)
    shard_dir = directory / SHARDS_DIR
    partials = sorted(p.name for p in shard_dir.glob("*.partial")) if shard_dir.is_dir() else []
    if partials:
        raise UsageError(
            f"{directory} is not finished ({partials[0]} is still open); "
            f"finish it first: eagle-datagen resume --out {directory}"
        )
    return _Run(directory, manifest, int(partition["index"]), int(partition["count"]))


def _refuse_live_writer(directory: Path) -> None:
    check_not_in_use(directory)  # DirectoryInUse names the pid and how to stop it


def _without_partition(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if k != "partition"}


def _check_plans(runs: list[_Run]) -> None:
    base = runs[0]
    for run in runs[1:]:
        changed = plan_differences(_without_partition(base.manifest.plan), _without_partition(run.manifest.plan))
        if changed:
            raise UsageError(
                f"{run.directory} was made with another plan than {base.directory}: {', '.join(changed)} differ; "
                "only runs of one job array (the same prompts, tokenizer, kwargs and sampling) can be merged"
            )
    counts = {run.count for run in runs}
    if len(counts) > 1:
        raise UsageError(f"the runs split the keys into different numbers of partitions: {sorted(counts)}")


def _check_partition_set(runs: list[_Run]) -> None:
    count = runs[0].count
    seen: dict[int, Path] = {}
    for run in runs:
        if run.index in seen:
            raise UsageError(f"partition {run.index}/{count} appears twice: {seen[run.index]} and {run.directory}")
        seen[run.index] = run.directory
    absent = [f"{i}/{count}" for i in range(count) if i not in seen]
    if absent:
        raise UsageError(
            f"{len(absent)} of {count} partitions are missing: {', '.join(absent[:EXAMPLES])}"
            + (" …" if len(absent) > EXAMPLES else "")
            + "; give every partition's run directory"
        )


def _record_ids(run: _Run) -> Iterator[str]:
    shard_dir = run.directory / SHARDS_DIR
    for info in run.manifest.shards:
        yield from shard_ids(shard_dir / info.name, info.records)


def _base_of(rid: str) -> str:
    """A record id without its turn (``KEY@t2`` → ``KEY``; ``KEY#1@t2`` → ``KEY#1``)."""
    split = split_turn_id(rid)
    return rid if split is None else split[0]


def _key_of(rid: str, samples: int) -> str:
    base = _base_of(rid)
    return base if samples == 1 else base.rsplit("#", 1)[0]


def _ended_conversations(runs: list[_Run]) -> set[str]:
    return {
        e["base"] for run in runs for e in read_entries(run.directory / ENDS_NAME) if isinstance(e.get("base"), str)
    }


def _partition_of_record(rid: str, samples: int, count: int) -> int:
    return partition_of(_key_of(rid, samples), count)


def _plan_prompts(plan: dict[str, Any]) -> Path:
    path = (plan.get("prompts") or {}).get("path")
    if not path or not Path(path).exists():
        raise UsageError(f"the prompts file of the plan ({path}) is not here; pass --prompts PATH")
    return Path(path)


def _prompt_keys(source: Path, plan: dict[str, Any]) -> Iterator[str]:
    columns = (plan.get("prompts") or {}).get("columns") or {}
    reader = PromptReader(source, on_bad=lambda exc: None, columns=Columns(**columns))
    for row in reader:
        yield row.key


def _set_aside_keys(runs: list[_Run]) -> set[str]:
    keys: set[str] = set()
    for run in runs:
        keys.update(e["key"] for e in read_entries(run.directory / REJECTS_NAME) if isinstance(e.get("key"), str))
    return keys


def _failed_ids(runs: list[_Run]) -> dict[str, int]:
    failed: dict[str, int] = {}
    for position, run in enumerate(runs):
        for entry in read_entries(run.directory / FAILURES_NAME):
            if isinstance(entry.get("id"), str):
                failed[entry["id"]] = position
    return failed


def _first(examples: list[str]) -> str:
    return ", ".join(examples[:EXAMPLES]) + (" …" if len(examples) > EXAMPLES else "")


def _write(out: Path, runs: list[_Run], *, copy: bool, records: int, set_aside: int) -> MergeReport:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not empty; give a new directory to merge into")
    shard_out = out / SHARDS_DIR
    shard_out.mkdir(parents=True, exist_ok=True)
    base = runs[0].manifest
    plan = _without_partition(base.plan)
    merged = Manifest(path=out / MANIFEST_NAME, plan=plan, facts=base.facts, server={})
    report = MergeReport(out, len(runs), records, 0, set_aside, copy)
    index = 0
    for run in runs:
        shard_dir = run.directory / SHARDS_DIR
        first = index
        for info in sorted(run.manifest.shards, key=lambda s: s.name):
            if not SHARD_RE.match(info.name):
                continue
            name = shard_name(index)
            for suffix in (".jsonl", ".ids"):
                src = (shard_dir / info.name).with_suffix(suffix)
                if src.exists():
                    _place(src.resolve(), (shard_out / name).with_suffix(suffix), copy=copy)
            merged.shards.append(ShardInfo(name, info.records, info.sha256))
            index += 1
        entry = {
            "command": "merge",
            "merged_from": str(run.directory.resolve()),
            "partition": f"{run.index}/{run.count}",
            "shards": [shard_name(i) for i in range(first, index)],
            "records": sum(s.records for s in run.manifest.shards),
        }
        merged.runs.append(entry)
        report.per_run.append(entry)
    report.shards = index
    ends = [run.directory / ENDS_NAME for run in runs if (run.directory / ENDS_NAME).is_file()]
    if ends:  # --turns all: how each conversation ended, one file for the merged run
        with (out / ENDS_NAME).open("wb") as handle:
            for path in ends:
                handle.write(path.read_bytes())
    merged.save()
    (out / "merge.json").write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return report


def _place(src: Path, dst: Path, *, copy: bool) -> None:
    if copy:
        shutil.copyfile(src, dst)
    else:
        os.symlink(src, dst)
