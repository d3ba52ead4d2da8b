"""``eagle-datagen show``: a known record, line by line; selection; colors only on request or a terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from eagle_datagen.cli import main


@pytest.fixture
def run_dir(tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any) -> Path:
    tok = hf_tokenizer
    ids = tok.convert_tokens_to_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    reasoning = tok.encode("Let me think", add_special_tokens=False)
    answer = tok.encode("The answer is 42.", add_special_tokens=False)
    call = [ids("<|tool_calls_section_begin|>"), *tok.encode('{"name": "add"}', add_special_tokens=False)]
    eos = ids("<|im_end|>")
    records = [
        {"id": "plain", "key": "plain", "sample": 0, "prompt_ids": prompt,
         "output_ids": [*reasoning, ids("</think>"), *answer, eos],
         "finish_reason": {"type": "stop", "matched": eos}, "completion_tokens": 0,
         "started": 100.0, "finished": 101.5, "server": "http://node1:30000"},
        {"id": "tool", "key": "tool", "sample": 0, "prompt_ids": prompt,
         "output_ids": [*reasoning, ids("</think>"), *answer, *call, eos],
         "finish_reason": {"type": "stop", "matched": eos}, "completion_tokens": 0, "variant": "thinking",
         "chat_template_kwargs": {"thinking": True}, "sampling_params": {"temperature": 0.6}},
        {"id": "cut", "key": "cut", "sample": 0, "prompt_ids": prompt, "output_ids": reasoning,
         "finish_reason": {"type": "length"}, "completion_tokens": 0},
    ]  # fmt: skip
    for r in records:
        r["completion_tokens"] = len(r["output_ids"])
    out = tmp_path / "run"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "shard_00000.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    facts = {"think_open_id": ids("<think>"), "think_close_id": ids("</think>"), "eos_token_ids": [eos]}
    manifest = {"format": 1, "plan": {"tokenizer": {"path": str(tiny_tokenizer)}}, "facts": facts, "runs": []}
    (out / "manifest.json").write_bytes(orjson.dumps(manifest))
    return out


def show(*args: str) -> Any:
    return CliRunner().invoke(main, ["show", *args], catch_exceptions=False)


def test_a_known_record_line_by_line(run_dir: Path, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.convert_tokens_to_ids
    n_prompt = len(orjson.loads((run_dir / "shards" / "shard_00000.jsonl").read_bytes().splitlines()[0])["prompt_ids"])
    n_reason = len(hf_tokenizer.encode("Let me think", add_special_tokens=False))
    n_answer = len(hf_tokenizer.encode("The answer is 42.", add_special_tokens=False))
    n_out = n_reason + 1 + n_answer + 1
    result = show(str(run_dir), "plain")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "record plain  key 'plain' sample 0  shards/shard_00000.jsonl:1",
        f"finish: stop (matched id {ids('<|im_end|>')} ⟦<|im_end|>⟧); output {n_out} ids (completion_tokens {n_out})",
        "server: http://node1:30000; 1.500 s",
        f"loss mask: prompt_len {n_prompt}: an export masks ids [0, {n_prompt}) and trains on [{n_prompt}, {n_prompt + n_out})",
        f"── prompt: {n_prompt} ids ──",
        "⟦<|im_user|>⟧user⟦<|im_middle|>⟧hi⟦<|im_end|>⟧⟦<|im_assistant|>⟧assistant⟦<|im_middle|>⟧⟦<think>⟧",
        f"── reasoning: output[0:{n_reason}] ({n_reason} ids) ──",
        "Let me think",
        f"── think-close: output[{n_reason}] = {ids('</think>')} ──",
        f"── answer: output[{n_reason + 1}:{n_out - 1}] ({n_answer} ids) ──",
        "The answer is 42.",
        f"── stop: output[{n_out - 1}] = {ids('<|im_end|>')} ⟦<|im_end|>⟧ ──",
    ]
    assert "\x1b[" not in result.output  # not a terminal: plain text


def test_tool_call_variant_and_a_cut_output(run_dir: Path) -> None:
    lines = show(str(run_dir), "tool").output.splitlines()
    assert lines[2] == 'variant: thinking; template kwargs {"thinking":true}; sampling {"temperature":0.6}'
    at = next(i for i, line in enumerate(lines) if line.startswith("── tool call: output["))
    assert lines[at + 1] == '⟦<|tool_calls_section_begin|>⟧{"name": "add"}'
    assert lines[at + 2].startswith("── stop: output[")
    cut = show(str(run_dir), "--where", "finish=length").output.splitlines()
    assert cut[0].startswith("record cut ")
    assert cut[-5:] == [
        "── reasoning: output[0:3] (3 ids) ──",  # never closed: cut inside the reasoning
        "Let me think",
        "── answer: output[3:3] (0 ids) ──",
        "(empty)",
        "── cut at max_new_tokens: 3 ids, no stop id ──",
    ]


def test_selection_colors_and_refusals(run_dir: Path) -> None:
    picked = show(str(run_dir), "--random", "2", "--seed", "3").output
    assert picked.count("\nrecord ") + picked.startswith("record ") == 2
    colored = show(str(run_dir), "plain", "--color").output
    assert "\x1b[" in colored
    unknown = CliRunner().invoke(main, ["show", str(run_dir), "--where", "colour=red"])
    assert unknown.exit_code == 2 and "FIELD one of finish, variant, server, turn, key, sample" in unknown.output
    missing = CliRunner().invoke(main, ["show", str(run_dir), "nope"])
    assert missing.exit_code == 2 and "no record with id 'nope'" in missing.output
