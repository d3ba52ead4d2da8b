"""``verify-shard``: a clean run passes; each planted corruption is caught with its kind, file and line."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.generate.pipeline import record_ids
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.inputs.render import Renderer, load_tokenizer, tokenizer_facts
from eagle_datagen.inputs.sources import file_identity
from eagle_datagen.record.family import prompt_shape
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.store.shards import ShardStore
from eagle_datagen.verify.verify import Report, _compact_int_lists, _exact_types_problem, format_report, verify

MAX_NEW_TOKENS = 40
SHARD_SIZE = 8
PROMPTS = 12  # shard_00000.jsonl holds records 0-7, shard_00001.jsonl.partial records 8-11
PLANTED = 5  # the record corrupted in each test: shard_00000.jsonl, line 6

Plant = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]


@dataclass
class Run:
    out: Path
    prompts: Path
    records: list[dict[str, Any]]
    vocab_size: int
    think_open: int
    think_close: int
    eos: int

    @property
    def shard0(self) -> Path:
        return self.out / "shards" / "shard_00000.jsonl"

    @property
    def partial(self) -> Path:
        return self.out / "shards" / "shard_00001.jsonl.partial"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer: Path) -> Any:
    return load_tokenizer(tiny_tokenizer)


def model_output(
    tokenizer: Any, prompt_ids: list[int], index: int, *, thinking: bool
) -> tuple[list[int], dict[str, Any]]:
    """What a reasoning model would return: reasoning, think-close, answer, stop id; every 5th is cut at the limit."""
    think_close = tokenizer.convert_tokens_to_ids("</think>")
    reasoning = tokenizer.encode(f"Let me think step by step about {index}", add_special_tokens=False)
    answer = tokenizer.encode(f"The answer is {index}.", add_special_tokens=False)
    if index % 5 == 4:
        output = (reasoning * MAX_NEW_TOKENS)[:MAX_NEW_TOKENS]
        return output, {"type": "length", "length": MAX_NEW_TOKENS}
    body = [*reasoning, think_close, *answer] if thinking else answer
    return [*body, tokenizer.eos_token_id], {"type": "stop", "matched": tokenizer.eos_token_id}


def make_run(
    tmp_path: Path,
    tokenizer_dir: Path,
    tokenizer: Any,
    *,
    plant: dict[int, Plant] | None = None,
    kwargs: dict[str, Any] | None = None,
    samples_per_prompt: int = 1,
) -> Run:
    """A run directory written by the real ShardStore and Manifest, with records corrupted before writing."""
    kwargs = kwargs or {}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(PROMPTS))
    out = tmp_path / "out"
    facts = tokenizer_facts(tokenizer, tokenizer_dir)
    plan = {
        "prompts": file_identity(prompts),
        "tokenizer": {"path": str(tokenizer_dir), "fingerprint": facts.fingerprint},
        "chat_template_kwargs": kwargs,
        "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0},
        "samples_per_prompt": samples_per_prompt,
        "shard_size": SHARD_SIZE,
    }
    out.mkdir()
    manifest = Manifest(out / MANIFEST_NAME, plan)
    manifest.facts = {
        "vocab_size": facts.vocab_size,
        "model_vocab_size": None,
        "eos_token_ids": list(facts.eos_token_ids),
        "stop_token_ids": list(facts.eos_token_ids),
        "think_open_id": facts.think_open_id,
        "think_close_id": facts.think_close_id,
    }
    manifest.save()
    store = ShardStore(out / "shards", SHARD_SIZE, manifest.add_shard)
    store.open({})
    renderer = Renderer(tokenizer, kwargs)
    thinking = kwargs.get("thinking") is not False
    records: list[dict[str, Any]] = []
    for row in PromptReader(prompts):
        prompt_ids = renderer.render(row)
        for rid, sample in record_ids(row.key, samples_per_prompt):
            output, finish = model_output(tokenizer, prompt_ids, len(records), thinking=thinking)
            record = {"id": rid, "key": row.key, "sample": sample, "prompt_ids": prompt_ids, "output_ids": output,
                      "finish_reason": finish, "completion_tokens": len(output)}  # fmt: skip
            if plant and len(records) in plant:
                record = plant[len(records)](record, records)
            store.append(str(len(records)), orjson.dumps(record) + b"\n")
            records.append(record)
    store.close()
    assert facts.think_open_id is not None and facts.think_close_id is not None
    return Run(
        out, prompts, records, facts.vocab_size, facts.think_open_id, facts.think_close_id, tokenizer.eos_token_id
    )


def kinds_at(report: Report, severity: str = "error") -> dict[str, list[tuple[str, int | None, str | None]]]:
    examples = report.examples["error" if severity == "error" else "warning"]
    return {kind: [(Path(f.path).name, f.line, f.id) for f in found] for kind, found in examples.items()}


def edit(record: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**record, **changes}


# --- a clean run ------------------------------------------------------------------------------------


def test_a_clean_run_passes_every_check(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    report = verify([run.out])
    assert report.ok, format_report(report)
    assert report.records == PROMPTS and not report.warnings
    assert [(Path(s.path).name, s.state, s.records) for s in report.shards] == [
        ("shard_00000.jsonl", "finalized", 8), ("shard_00001.jsonl.partial", "in_progress", 4),
    ]  # fmt: skip
    assert report.shards[0].checksum == "ok" and report.shards[0].manifest_records == 8
    assert report.not_checked == []
    assert "OK: no errors" in format_report(report)


def test_a_clean_run_with_thinking_off_and_several_samples_passes(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any
) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer, kwargs={"thinking": False}, samples_per_prompt=2)
    assert prompt_shape(run.records[0]["prompt_ids"], run.think_open, run.think_close) == "closed"
    report = verify([run.out])
    assert report.ok, format_report(report)
    assert report.records == 2 * PROMPTS


def test_the_cli_exits_0_on_a_clean_run_and_prints_json(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    result = CliRunner().invoke(main, ["verify-shard", str(run.out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.output)
    assert data["ok"] is True and data["records"] == PROMPTS and data["errors"] == {}


# --- planted corruptions ----------------------------------------------------------------------------


def drop_stop_token(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, output_ids=r["output_ids"][:-1], completion_tokens=r["completion_tokens"] - 1)


def extra_token(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, output_ids=[*r["output_ids"], 100], completion_tokens=r["completion_tokens"] + 1)


def truncated_prompt(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, prompt_ids=r["prompt_ids"][: len(r["prompt_ids"]) // 2])


def prompt_without_think_open(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, prompt_ids=r["prompt_ids"][:-1])


def duplicate_id(_: dict[str, Any], written: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(written[1])


def out_of_vocab(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, output_ids=[*r["output_ids"][:3], 10**6, *r["output_ids"][4:]])


def wrong_completion_tokens(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, completion_tokens=r["completion_tokens"] + 1)


def prompt_tail_leak(r: dict[str, Any], _: Any) -> dict[str, Any]:
    output = [*r["prompt_ids"][-5:], *r["output_ids"]]
    return edit(r, output_ids=output, completion_tokens=len(output))


def length_with_short_output(r: dict[str, Any], _: Any) -> dict[str, Any]:
    output = r["output_ids"][:-1]
    return edit(r, output_ids=output, completion_tokens=len(output), finish_reason={"type": "length", "length": 40})


def aborted(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, finish_reason={"type": "abort", "message": "client disconnected"})


def missing_field(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "finish_reason"}


def id_not_from_key(r: dict[str, Any], _: Any) -> dict[str, Any]:
    return edit(r, sample=1)


def think_open_in_output(r: dict[str, Any], _: Any) -> dict[str, Any]:
    output = [514, *r["output_ids"]]  # the tiny tokenizer's <think>
    return edit(r, output_ids=output, completion_tokens=len(output))


def closes_twice(r: dict[str, Any], _: Any) -> dict[str, Any]:
    output = [515, *r["output_ids"]]  # the tiny tokenizer's </think>, again
    return edit(r, output_ids=output, completion_tokens=len(output))


@pytest.mark.parametrize(
    ("plant", "kinds"),
    [
        (drop_stop_token, {"stop_token"}),
        (extra_token, {"stop_token"}),
        (truncated_prompt, {"prompt_mismatch"}),  # it ends without a generation prompt: nothing is asked of it
        (prompt_without_think_open, {"prompt_mismatch", "think_prompt"}),
        (duplicate_id, {"duplicate_id"}),
        (out_of_vocab, {"out_of_vocab"}),
        (wrong_completion_tokens, {"completion_tokens"}),
        (prompt_tail_leak, {"prompt_tail_leak"}),  # a broken record: its structure is not judged on top
        (length_with_short_output, {"length"}),
        (aborted, {"abort"}),
        (missing_field, {"schema"}),
        (id_not_from_key, {"id_mismatch"}),
        (think_open_in_output, {"think_twice"}),
        (closes_twice, {"think_closed_twice"}),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_each_planted_corruption_is_caught_at_its_line(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any, plant: Plant, kinds: set[str]
) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: plant})
    report = verify([run.out])
    assert not report.ok
    assert set(report.errors) == kinds, format_report(report)
    found = kinds_at(report)
    rid = run.records[PLANTED]["id"]
    for kind in kinds:
        assert found[kind] == [("shard_00000.jsonl", PLANTED + 1, rid)], (kind, format_report(report))
        assert report.errors[kind] == 1


def test_a_prompt_rendered_with_other_template_kwargs_is_caught(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any
) -> None:
    thinking_off = Renderer(tokenizer, {"thinking": False})
    rows = list(PromptReader(write_jsonl(tmp_path / "rows.jsonl", varied_rows(PROMPTS))))

    def other_kwargs(r: dict[str, Any], _: Any) -> dict[str, Any]:
        return edit(r, prompt_ids=thinking_off.render(rows[PLANTED]))

    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: other_kwargs})
    report = verify([run.out])
    assert set(report.errors) == {"prompt_mismatch", "think_when_off"}, format_report(report)
    assert kinds_at(report)["prompt_mismatch"] == [("shard_00000.jsonl", PLANTED + 1, run.records[PLANTED]["id"])]
    # without the prompts file, its output gives it away: </think> although the prompt turned thinking off
    report = verify([run.out], rerender=False)
    assert set(report.errors) == {"think_when_off"}
    assert [line for _, line, _ in kinds_at(report)["think_when_off"]] == [PLANTED + 1]


def test_a_prompt_missing_its_think_open_is_caught_without_the_prompts_file(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any
) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: prompt_without_think_open})
    report = verify([run.out], rerender=False)
    assert set(report.errors) == {"think_prompt"}
    (example,) = report.examples["error"]["think_prompt"]
    assert (example.line, example.id) == (PLANTED + 1, run.records[PLANTED]["id"])
    assert "ends with the generation prompt's head but not its think-open 514" in example.message
    assert any("prompt re-render (turned off)" in n for n in report.not_checked)


def test_a_checksum_mismatch_and_a_lost_line_are_caught(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    data = run.shard0.read_bytes()
    run.shard0.write_bytes(data.replace(b'"completion_tokens":', b'"completion_tokens": ', 1))
    report = verify([run.out])
    assert set(report.errors) == {"shard_checksum"}
    assert kinds_at(report)["shard_checksum"] == [("shard_00000.jsonl", None, None)]
    assert report.shards[0].checksum == "mismatch"

    run.shard0.write_bytes(b"".join(data.splitlines(keepends=True)[:-1]))
    report = verify([run.out])
    assert set(report.errors) == {"shard_checksum", "shard_count"}
    assert "7 records but the manifest says 8" in report.examples["error"]["shard_count"][0].message


def test_a_torn_line_is_a_warning_in_a_live_partial_and_an_error_when_given(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any
) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    run.partial.write_bytes(run.partial.read_bytes() + orjson.dumps(run.records[0])[:50])
    report = verify([run.out])
    assert report.ok and kinds_at(report, "warning")["torn_line"] == [("shard_00001.jsonl.partial", 5, "p0")]

    report = verify([run.partial])
    assert set(report.errors) == {"torn_line"}
    assert kinds_at(report)["torn_line"] == [("shard_00001.jsonl.partial", 5, "p0")]  # the id survived the cut
    assert report.shards[0].state == "partial"


def test_a_line_that_is_not_json_is_a_parse_error(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    run.partial.write_bytes(run.partial.read_bytes() + b'{"id":"zz","key":\n')
    report = verify([run.partial])
    assert kinds_at(report) == {"parse": [("shard_00001.jsonl.partial", 5, "zz")]}


def test_a_shard_the_manifest_lists_but_is_gone_is_an_error(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any
) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    run.shard0.unlink()
    report = verify([run.out])
    assert set(report.errors) == {"shard_missing"}


def test_a_missing_source_row_is_reported(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer)
    lines = run.prompts.read_bytes().splitlines(keepends=True)
    run.prompts.write_bytes(b"".join(lines[:PLANTED] + lines[PLANTED + 1 :]))
    report = verify([run.out])
    assert kinds_at(report) == {"prompt_row_missing": [("shard_00000.jsonl", PLANTED + 1, run.records[PLANTED]["id"])]}
    assert set(report.warnings) == {"prompts_changed"}


def test_a_stop_finish_that_never_closes_reasoning_is_a_warning(
    tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any
) -> None:
    def no_close(r: dict[str, Any], _: Any) -> dict[str, Any]:
        output = [t for t in r["output_ids"] if t != 515]
        return edit(r, output_ids=output, completion_tokens=len(output))

    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: no_close})
    report = verify([run.out])
    assert report.ok
    assert kinds_at(report, "warning") == {
        "stop_in_reasoning": [("shard_00000.jsonl", PLANTED + 1, run.records[PLANTED]["id"])]
    }


# --- bare shard files -------------------------------------------------------------------------------


def test_bare_shard_files_say_what_was_not_checked(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: out_of_vocab})
    bare = tmp_path / "bare" / "shard_00000.jsonl"
    bare.parent.mkdir()
    shutil.copy(run.shard0, bare)

    report = verify([bare])
    assert report.ok  # the vocabulary is unknown: a large id cannot be judged
    text = format_report(report)
    assert "the vocabulary bound" in text and "shard counts and sha256" in text
    assert report.shards[0].manifest_records is None

    report = verify([bare], tokenizer=tiny_tokenizer)
    assert kinds_at(report) == {"out_of_vocab": [("shard_00000.jsonl", PLANTED + 1, run.records[PLANTED]["id"])]}
    assert not any("vocabulary" in n for n in report.not_checked)


def test_a_shard_file_inside_a_run_uses_the_runs_manifest(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: length_with_short_output})
    report = verify([run.shard0, run.out])  # given twice: checked once
    assert report.records == PROMPTS
    assert set(report.errors) == {"length"}
    assert report.shards[0].checksum == "ok"


def test_ids_written_in_another_layout_take_the_exact_path(tmp_path: Path) -> None:
    shard = tmp_path / "shard_00000.jsonl"
    good = {"id": "a", "key": "a", "sample": 0, "prompt_ids": [1, 2, 514], "output_ids": [7, 515, 8, 513],
            "finish_reason": {"type": "stop", "matched": 513}, "completion_tokens": 4}  # fmt: skip
    bad_outputs: list[Any] = [[7, 8.0, 513], [7, -1, 513], [7, True, 513], [7, None, 513], [None], ["7", "513"],
                              [[7], [513]]]  # fmt: skip
    lines = [orjson.dumps(good, option=orjson.OPT_INDENT_2).replace(b"\n", b"") + b"\n"]  # spaces: exact path, clean
    lines += [
        orjson.dumps({**good, "id": f"b{i}", "key": f"b{i}", "output_ids": o}) + b"\n"
        for i, o in enumerate(bad_outputs)
    ]
    exponent = orjson.dumps({**good, "id": "e", "key": "e", "output_ids": [7, 555, 513]}).replace(b"555", b"5e2")
    lines.append(exponent + b"\n")
    shard.write_bytes(b"".join(lines))
    report = verify([shard])
    found = kinds_at(report)
    assert found.pop("out_of_vocab") == [("shard_00000.jsonl", 3, "b1")]
    assert report.examples["error"]["schema"][-1].message == "output_ids[1] is 500.0, not an integer id"
    assert found == {
        "schema": [
            ("shard_00000.jsonl", n, i) for n, i in [(2, "b0"), *((k + 2, f"b{k}") for k in range(2, 7)), (9, "e")]
        ]
    }


def test_the_byte_proof_of_int_lists_never_accepts_what_the_exact_path_rejects() -> None:
    """Random well-formed and malformed lists through both paths (they must agree whenever the fast one says yes)."""
    rng = random.Random(0)
    atoms: list[Any] = [0, 7, 514, 163606, -1, 2.5, True, None, "7", [7], {"a": 1}, 2**63]
    accepted = 0
    for i in range(4000):
        prompt = [rng.choice(atoms[:4]) if rng.random() < 0.9 else rng.choice(atoms) for _ in range(rng.randint(1, 4))]
        output = [rng.choice(atoms[:4]) if rng.random() < 0.9 else rng.choice(atoms) for _ in range(rng.randint(1, 6))]
        option = orjson.OPT_INDENT_2 if i % 3 == 0 else 0
        raw = orjson.dumps({"id": "a", "prompt_ids": prompt, "output_ids": output}, option=option).replace(b"\n", b"")
        exact = _exact_types_problem(prompt, output) is None and min(prompt + output) >= 0
        if _compact_int_lists(raw + b"\n", prompt, output) is not None:
            accepted += 1
            assert exact, raw
    assert accepted > 1000


def test_the_record_checks_fast_path_on_compact_text_gives_the_exact_paths_verdicts() -> None:
    """check_record with verify's compact-text hint (no min() scans, early stop ids found with memmem) must give
    the same verdict as without it, on random outputs with stop ids anywhere, for stop, length and text stops."""
    from eagle_datagen.record.checks import RecordSpec, check_record

    rng = random.Random(1)
    stops = frozenset({163586, 163585})
    spec = RecordSpec(vocab_size=163840, stop_ids=stops)
    pool = [0, 5, 1635, 16358, 163586, 163585, 63586, 1635860, 163839, 163840, 86]
    differ = 0
    for i in range(6000):
        output = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
        prompt = [rng.choice(pool[:4]) for _ in range(rng.randint(1, 4))]
        kind = rng.choice(["stop", "stop", "length", "text"])
        finish: dict[str, Any] = (
            {"type": "stop", "matched": output[-1]} if kind == "stop"
            else {"type": "length", "length": len(output)} if kind == "length"
            else {"type": "stop", "matched": "END"}
        )  # fmt: skip
        raw = orjson.dumps({"id": "a", "key": "a", "sample": 0, "prompt_ids": prompt, "output_ids": output})
        compact = _compact_int_lists(raw + b"\n", prompt, output)
        assert compact, raw  # orjson's layout: digits and commas only
        args = (spec, prompt, output, finish, len(output))
        exact = check_record(*args, max_new_tokens=len(output) if i % 2 else None)
        fast = check_record(*args, max_new_tokens=len(output) if i % 2 else None, compact_output=compact)
        assert (fast.errors, fast.warnings) == (exact.errors, exact.warnings), (output, finish)
        differ += bool(exact.errors)
    assert 500 < differ < 5500  # both verdicts occur


def test_prompt_shapes() -> None:
    assert prompt_shape([1, 2, 514], 514, 515) == "open"
    assert prompt_shape([1, 514, 198], 514, 515) == "open"  # <think>\n
    assert prompt_shape([1, 514, 515], 514, 515) == "closed"
    assert prompt_shape([514, 271, 515, 271], 514, 515) == "closed"  # Qwen3 with thinking off
    assert prompt_shape([1, 2, 515], 514, 515) == "closed"  # DeepSeek-V3.1 chat mode
    assert prompt_shape([514, 1, 2, 3, 4], 514, 515) == "plain"
    assert prompt_shape([1, 2, 3], 514, 515) == "plain"


def test_the_cli_exits_1_and_names_kind_file_line_and_id(tmp_path: Path, tiny_tokenizer: Path, tokenizer: Any) -> None:
    run = make_run(tmp_path, tiny_tokenizer, tokenizer, plant={PLANTED: drop_stop_token})
    result = CliRunner().invoke(main, ["verify-shard", str(run.out)], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"shard_00000.jsonl:{PLANTED + 1} id {run.records[PLANTED]['id']!r}: finish matched" in result.output
    assert "stop_token: 1" in result.output and "FAILED: 1 error(s)" in result.output


def test_a_run_made_through_the_fake_server_verifies(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(60))
    out = tmp_path / "out"
    args = ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
            "--server-url", fake_server.url, "--no-progress", "--shard-size", "25", "--max-new-tokens", "48"]  # fmt: skip
    assert CliRunner().invoke(main, args, catch_exceptions=False).exit_code == 0
    report = verify([out])
    assert report.records == 60 and [s.checksum for s in report.shards[:2]] == ["ok", "ok"]
    # the fake (family mode) writes what the tiny Kimi-style family writes: every record passes, no warning
    assert report.ok and not report.warnings, format_report(report)
