"""Our exports loaded by the trainers' own code: speculators 0.9.0 and SpecForge 0.2.0 (installed --no-deps
into .trainers by scripts/setup-trainers.sh, on .venv-sglang's CPU torch). One subprocess exports with our CLI
and loads every file with their loaders (tests/trainer_loaders.py); here we compare what they produced with
the records. Without .trainers the tests skip, or fail when the CI env var is set.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from export_data import EOS, VOCAB, expected_rows, make_run, single_records, turn_records

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang")) / "bin" / "python"
TRAINERS = Path(os.environ.get("TRAINERS_DIR", ROOT / ".trainers"))
DRAFT_SIZES = (64, 900)  # 900 > the distinct output ids: the padded case

pytestmark = [pytest.mark.trainers, pytest.mark.slow]  # one ~25-50 s subprocess for the module


def merged_expected(records: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """One row per conversation: the last turn's prompt + output, every turn's output under mask 1."""
    out = []
    for key in dict.fromkeys(r["conversation"] for r in records):
        turns = [r for r in records if r["conversation"] == key]
        last = turns[-1]
        ids = last["prompt_ids"] + last["output_ids"]
        mask = [0] * len(ids)
        for t in turns:
            start = len(t["prompt_ids"])
            mask[start : start + len(t["output_ids"])] = [1] * len(t["output_ids"])
        out.append((ids, mask))
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not (TRAINERS / ".setup-trainers.stamp").is_file() or not SGLANG_PYTHON.is_file():
        message = f"no trainers env ({TRAINERS}, {SGLANG_PYTHON}): run scripts/setup-trainers.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from eagle_datagen.testing.tiny import build_tiny_tokenizer

    tmp = tmp_path_factory.mktemp("trainers")
    single = single_records(30)
    turns = turn_records(6, 3)
    runs = {
        "single": make_run(tmp, single, name="single"),
        "turns": make_run(tmp, turns, name="turns", samples=None),
        "turns-merged": make_run(tmp, turns, name="turns-merged", samples=None),
    }
    work = tmp / "work"
    work.mkdir()
    request = {
        "runs": {name: str(run.out) for name, run in runs.items()},
        "tokenizer": str(build_tiny_tokenizer(tmp / "tok", template="chatml")),
        "work": str(work),
        "draft_sizes": list(DRAFT_SIZES),
        "vocab": VOCAB,
    }
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TRAINERS), str(ROOT / "tests" / "sglang_shims"), str(ROOT / "src")]),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf-datasets"),
        TRANSFORMERS_VERBOSITY="error",
    )
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(ROOT / "tests" / "trainer_loaders.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    result["records"] = {"single": single, "turns": turns}
    return result


def as_pairs(rows: list[list[list[int]]]) -> list[tuple[list[int], list[int]]]:
    return [(ids, mask) for ids, mask in rows]


@pytest.mark.parametrize("run", ["single", "turns"])
def test_specforge_prompt_builder_gives_our_ids_and_masks(loaded: dict[str, Any], run: str) -> None:
    assert as_pairs(loaded["rows"][f"{run}/specforge"]) == expected_rows(loaded["records"][run])


@pytest.mark.parametrize("run", ["single", "turns"])
def test_speculators_arrow_dataset_accepts_every_row(loaded: dict[str, Any], run: str) -> None:
    assert as_pairs(loaded["rows"][f"{run}/arrow"]) == expected_rows(loaded["records"][run])


@pytest.mark.parametrize("run", ["single", "turns"])
def test_speculators_prepare_data_keeps_our_rows(loaded: dict[str, Any], run: str) -> None:
    # prepare-data shuffles rows (seed 0): the same rows, in its order
    assert sorted(as_pairs(loaded["rows"][f"{run}/prepare-data"])) == sorted(expected_rows(loaded["records"][run]))


@pytest.mark.parametrize("loader", ["specforge", "arrow", "prepare-data"])
def test_merged_turns_load_as_one_row_per_conversation(loaded: dict[str, Any], loader: str) -> None:
    got = as_pairs(loaded["rows"][f"turns-merged/{loader}"])
    want = merged_expected(loaded["records"]["turns"])
    assert (sorted(got) if loader == "prepare-data" else got) == (sorted(want) if loader == "prepare-data" else want)
    assert "6 conversations merged (18 turn records)" in loaded["messages"]["turns-merged-specforge"]


def reference_selection(records: list[dict[str, Any]], n: int) -> list[int]:
    """A slow reference: count output ids, rank by (-count, id), pad with the lowest unused ids."""
    counts: dict[int, int] = {}
    for r in records:
        for t in r["output_ids"]:
            counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    top += [t for t in range(VOCAB) if t not in set(top)][: n - len(top)]
    return sorted(top)


@pytest.mark.parametrize("n", DRAFT_SIZES)
def test_vocab_maps_load_in_both_trainers_and_match_the_reference(loaded: dict[str, Any], n: int) -> None:
    records = loaded["records"]["single"]
    want = reference_selection(records, n)
    for fmt in ("specforge", "speculators"):
        got = loaded["maps"][f"{fmt}/{n}"]
        assert got["selected"] == want
        assert got["d2t"] == [t - i for i, t in enumerate(want)]
    freq = dict(loaded["maps"][f"speculators/{n}"]["freq"])
    assert sum(freq.values()) == sum(len(r["output_ids"]) for r in records)
    assert freq[EOS] == sum(r["output_ids"].count(EOS) for r in records)
    report = loaded["maps"][f"report/{n}"]
    distinct = len({t for r in records for t in r["output_ids"]})
    assert report["distinct_ids"] == distinct and report["padded_ids"] == max(0, n - distinct)
    if n > distinct:
        assert "padded" in loaded["messages"][f"map-sf-{n}"]
