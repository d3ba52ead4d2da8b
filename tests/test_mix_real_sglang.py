"""A thinking on/off mix on a real SGLang 0.5.23 server (CPU): each record verifies with its own kwargs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, write_jsonl
from eagle_datagen.cli import main
from real_sglang import SGLangServer
from test_exact_real_sglang import ROWS, render

pytestmark = pytest.mark.sglang


def test_thinking_on_and_off_variants_verify_with_their_own_kwargs(
    tmp_path: Path, tiny_kimi_model: Path, sglang_server: SGLangServer
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["run", "--prompts", str(prompts), "--tokenizer", str(tiny_kimi_model), "--server-url", sglang_server.url,
         "--out", str(out), "--max-new-tokens", "12", "--no-progress", "--samples-per-prompt", "2", "--seed", "1",
         "--mix-entry", 'thinking:0.5:{"chat_template_kwargs": {"thinking": true}}',
         "--mix-entry", 'chat:0.5:{"chat_template_kwargs": {"thinking": false}, "sampling": {"temperature": 0.7}}'],
        catch_exceptions=False,
    )  # fmt: skip
    # The tiny model has random weights: sampling (the chat variant's 0.7) can draw a think token with thinking
    # off, which the shared per-record check refuses as it must (check_think_when_off). Only that may fail.
    failures = []
    if (out / "failures.jsonl").exists():
        failures = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert result.exit_code == (3 if failures else 0), result.output
    assert all(f["kind"] == "check_think_when_off" for f in failures), failures
    records = read_records(out)
    assert len(records) + len(failures) == 2 * len(ROWS)
    assert set(Counter(r["variant"] for r in records)) == {"thinking", "chat"}
    rows = {row["id"]: row for row in ROWS}
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_kimi_model)).convert_tokens_to_ids
    think_open, think_close = ids("<think>"), ids("</think>")
    for record in records:
        kwargs = record["chat_template_kwargs"]
        assert kwargs == {"thinking": record["variant"] == "thinking"}
        assert record["prompt_ids"] == render(tiny_kimi_model, rows[record["key"]], **kwargs)
        assert record["prompt_ids"][-1] == (think_open if kwargs["thinking"] else think_close)
        assert record["sampling_params"]["temperature"] == (0.7 if record["variant"] == "chat" else 0.0)
        assert isinstance(record["sampling_params"]["sampling_seed"], int)
    report = CliRunner().invoke(main, ["verify-shard", str(out), "--json"])
    verdict = orjson.loads(report.output)
    assert report.exit_code == 0 and verdict["ok"], verdict["errors"]
    assert verdict["records"] == len(records)
    assert not any("prompt re-render" in n for n in verdict["not_checked"])
    stats = CliRunner().invoke(main, ["stats", str(out)])
    assert stats.exit_code == 0 and "variants: chat " in stats.output
