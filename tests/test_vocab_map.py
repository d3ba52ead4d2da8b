"""``vocab-map``'s selection, padding and coverage against slow references (numpy only; the .pt/.npy files
are read by the trainers' own code in tests/test_export_trainers.py)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from eagle_datagen.cli import main
from eagle_datagen.export.source import open_source
from eagle_datagen.export.vocab import VocabOptions, build_map, count_tokens, coverage
from export_data import VOCAB, make_run, single_records


def reference(counts: dict[int, int], n: int, vocab: int) -> list[int]:
    top = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    chosen = set(top)
    top += [t for t in range(vocab) if t not in chosen][: n - len(top)]
    return sorted(top)


@pytest.mark.parametrize("seed", range(5))
def test_selection_ties_and_padding_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 300
    counts = {rng.randrange(vocab): rng.choice([1, 1, 2, 3, 3, 7]) for _ in range(rng.randrange(20, 200))}
    array = np.zeros(vocab, dtype=np.int64)
    for t, c in counts.items():
        array[t] = c
    for n in (1, 10, len(counts), len(counts) + 15, vocab):
        vmap = build_map(array, n)
        want = reference(counts, n, vocab)
        assert vmap.selected.tolist() == want
        assert vmap.d2t.dtype == np.int64 and vmap.t2d.dtype == np.bool_
        assert vmap.d2t.tolist() == [t - i for i, t in enumerate(want)]
        assert np.flatnonzero(vmap.t2d).tolist() == want and vmap.t2d.shape == (vocab,)
        assert vmap.padded == max(0, n - len(counts))


def test_ties_go_to_the_lower_id() -> None:
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 3, 5]] = 4  # three ids tie for two places
    counts[9] = 9
    assert build_map(counts, 3).selected.tolist() == [3, 5, 9]


def test_coverage_matches_a_slow_computation() -> None:
    counts = np.array([0, 5, 1, 3, 0, 1, 10], dtype=np.int64)
    cov = coverage(counts, 2)
    assert cov["tokens"] == 20 and cov["distinct_ids"] == 5
    assert cov["top_k_share"]["2"] == 0.75  # 10 + 5 of 20
    assert cov["top_k_share"]["8192"] == 1.0
    # 90 %: 18 tokens: 10+5+3 = 18 → 3 ids; 95 %: 19 → 4 ids; 99 %: 19.8 → 5 ids
    assert cov["ids_for_share"] == {"90": 3, "95": 4, "99": 5}


def test_counts_are_the_output_ids_of_the_checked_records(tmp_path: Path) -> None:
    records = single_records(40, seed=3)
    run = make_run(tmp_path, records)
    options = VocabOptions(
        run.out, 16, "speculators", tmp_path / "m", include_finish=frozenset({"stop"}), progress=False
    )
    counted = count_tokens(open_source(run.out), VOCAB, options)
    want = np.zeros(VOCAB, dtype=np.int64)
    kept = [r for r in records if r["finish_reason"]["type"] == "stop"]
    for r in kept:
        for t in r["output_ids"]:
            want[t] += 1
    assert np.array_equal(counted.counts, want)
    assert counted.used_records == len(kept) and counted.left_out == {"finish_length": len(records) - len(kept)}


def test_vocab_map_agrees_with_stats_coverage(tmp_path: Path) -> None:
    run = make_run(tmp_path, single_records(60, seed=5))
    options = VocabOptions(run.out, 16, "speculators", tmp_path / "m", progress=False)
    ours = coverage(count_tokens(open_source(run.out), VOCAB, options).counts, 16)
    from eagle_datagen.report.stats import collect

    theirs = collect(run.out).coverage
    assert {k: ours["top_k_share"][k] for k in theirs["top"]} == theirs["top"]
    assert ours["ids_for_share"] == theirs["ids_for"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_without_torch_the_extra_is_named(tmp_path: Path) -> None:
    run = make_run(tmp_path, single_records(4))
    result = CliRunner().invoke(
        main,
        ["vocab-map", str(run.out), "--draft-vocab-size", "8", "--format", "specforge", "--out", str(tmp_path / "m")],
    )
    assert result.exit_code == 2 and "pip install 'eagle-datagen[export]'" in result.output
    assert not (tmp_path / "m").exists()


def test_draft_size_over_the_vocabulary_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, single_records(4))
    result = CliRunner().invoke(
        main,
        [
            "vocab-map",
            str(run.out),
            "--draft-vocab-size",
            str(VOCAB + 1),
            "--format",
            "specforge",
            "--out",
            str(tmp_path / "m"),
        ],
    )
    assert result.exit_code == 2 and "larger than the target vocabulary" in result.output


def test_counting_refuses_a_directory_verify_rejects(tmp_path: Path) -> None:
    from eagle_datagen.export.command import ExportRefused

    records = single_records(6)
    records[2] = dict(records[2], output_ids=[*records[2]["output_ids"][:-1], VOCAB + 5])  # out of vocabulary
    run = make_run(tmp_path, records)
    options = VocabOptions(run.out, 4, "speculators", tmp_path / "m", progress=False)
    with pytest.raises(ExportRefused, match="out_of_vocab"):
        count_tokens(open_source(run.out), VOCAB, options)
    counted = count_tokens(
        open_source(run.out),
        VOCAB,
        VocabOptions(run.out, 4, "speculators", tmp_path / "m", skip_invalid=True, progress=False),
    )
    assert counted.left_out == {"invalid_out_of_vocab": 1} and counted.used_records == 5
