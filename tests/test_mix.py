"""Mixes: refused bad input, a deterministic 70/30 draw, per-record kwargs and sampling, resume."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, served_tools, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.inputs.mix import load_mix, sampling_seed
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.inputs.render import Renderer, load_tokenizer
from test_resume import cli, fake_process, read_records_tolerant

__all__ = ["fake_process"]  # the fixture, shared with test_resume

MIX_TOML = """
[variant.thinking]
weight = 0.7
chat_template_kwargs = { thinking = true }

[variant.chat]
weight = 0.3
chat_template_kwargs = { thinking = false }
sampling = { temperature = 0.6, top_p = 0.95 }
"""


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def mix_file(tmp_path: Path, text: str = MIX_TOML) -> Path:
    path = tmp_path / "mix.toml"
    path.write_text(text)
    return path


def test_70_30_over_10000_keys_is_within_2_percent_and_a_function_of_key_and_seed(tmp_path: Path) -> None:
    mix = load_mix(mix_file(tmp_path), seed=7)
    assert mix is not None
    keys = [f"row-{i}" for i in range(10_000)]
    first = {k: mix.choose(k, 0).name for k in keys}
    counts = Counter(first.values())
    assert abs(counts["thinking"] / 10_000 - 0.7) <= 0.02 and abs(counts["chat"] / 10_000 - 0.3) <= 0.02
    # a re-run, the keys in another order, or a partition of them: the same variant per key
    again = load_mix(mix_file(tmp_path), seed=7)
    assert again is not None
    shuffled = keys[:]
    random.Random(3).shuffle(shuffled)
    assert {k: again.choose(k, 0).name for k in shuffled} == first
    assert {k: again.choose(k, 0).name for k in shuffled[5000:]} == {k: first[k] for k in shuffled[5000:]}
    other = load_mix(mix_file(tmp_path), seed=8)
    assert other is not None and {k: other.choose(k, 0).name for k in keys} != first
    # per sample, samples of one key spread; per prompt, they stay together
    per_prompt = load_mix(mix_file(tmp_path), per="prompt", seed=7)
    assert per_prompt is not None
    assert all(len({per_prompt.choose(k, s).name for s in range(4)}) == 1 for k in keys[:500])
    assert any(len({mix.choose(k, s).name for s in range(4)}) > 1 for k in keys[:500])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mix-entry", 'a:1:{"chat_template_kwarg": {}}'],
         "--mix-entry 'a:1:{\"chat_template_kwarg\": {}}': variant 'a' has unknown field(s) 'chat_template_kwarg'"),
        (["--mix-entry", "a:0:{}", "--mix-entry", "b:0:{}"], "the mix's weights (a=0, b=0) must sum to a positive number"),
        (["--mix-entry", 'a:1:{"chat_template_kwargs": [1]}'], "variant 'a': chat_template_kwargs must be an object"),
        (["--mix-entry", "a:1:[1]"], "--mix-entry 'a:1:[1]': the JSON must be an object"),
        (["--mix-entry", "a:x:{}"], "--mix-entry 'a:x:{}': the weight 'x' is not a number"),
        (["--mix-entry", "a:-1:{}"], "variant 'a' needs a weight >= 0"),
        (["--mix-entry", "a{}"], "give NAME:WEIGHT:JSON"),
        (["--mix-entry", 'a:1:{"sampling": {"max_new_tokens": 5}}'], "sampling 'max_new_tokens' is the run's"),
        (["--mix-entry", 'a:1:{"sampling": {"temprature": 1}}'], "variant 'a': sampling parameter 'temprature'"),
        (["--mix-entry", "a:1:{}", "--mix-entry", "a:2:{}"], "the variant name 'a' is given twice"),
        (["--mix-per", "prompt"], "--mix-per needs a mix"),
    ],
)  # fmt: skip
def test_bad_mix_input_is_refused_at_start_naming_the_entry(
    tmp_path: Path, tiny_tokenizer: Path, args: list[str], message: str
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    result = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                                       "--tokenizer", str(tiny_tokenizer), "--server-url", "http://127.0.0.1:9", *args])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out" / "manifest.json").exists()  # refused before anything was written


def test_bad_mix_files_name_file_and_variant(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"mix.toml \[variant.chat\]: variant 'chat' has unknown field\(s\) 'temp'"):
        load_mix(mix_file(tmp_path, "[variant.chat]\nweight = 1\ntemp = 2\n"))
    with pytest.raises(UsageError, match=r"unknown key\(s\) 'variants'"):
        load_mix(mix_file(tmp_path, "[variants.chat]\nweight = 1\n"))
    with pytest.raises(UsageError, match="not valid TOML"):
        load_mix(mix_file(tmp_path, "[variant.chat\n"))
    with pytest.raises(UsageError, match=r"either --mix FILE\.toml or --mix-entry"):
        load_mix(mix_file(tmp_path), ["a:1:{}"])


def test_a_mixed_run_records_each_variant_and_renders_with_its_kwargs(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(120))
    out = tmp_path / "out"
    result = invoke("run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
                    "--server-url", fake_server.url, "--no-progress", "--max-new-tokens", "24",
                    "--mix", str(mix_file(tmp_path)), "--samples-per-prompt", "2", "--seed", "11")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "mix (per sample, seed 11): thinking 70 % kwargs" in result.output
    records = read_records(out)
    assert len(records) == 240
    mix = load_mix(mix_file(tmp_path), seed=11)
    assert mix is not None
    renderer = Renderer(load_tokenizer(tiny_tokenizer))
    rows = {r.key: r for r in PromptReader(prompts)}
    think_close = renderer.tokenizer.convert_tokens_to_ids("</think>")
    for record in records:
        variant = mix.choose(record["key"], record["sample"])
        assert record["variant"] == variant.name
        assert record["chat_template_kwargs"] == dict(variant.chat_template_kwargs)
        want = {"max_new_tokens": 24, "temperature": 0.0, **variant.sampling,
                "sampling_seed": sampling_seed(11, record["id"])}  # fmt: skip
        assert record["sampling_params"] == want
        row = rows[record["key"]]
        independent = renderer.tokenizer.apply_chat_template(
            row.messages,
            tools=served_tools(row.tools),
            add_generation_prompt=True,
            tokenize=True,
            **variant.chat_template_kwargs,
        )
        independent = independent["input_ids"] if hasattr(independent, "keys") else independent
        assert record["prompt_ids"] == list(independent)
        assert (record["prompt_ids"][-1] == think_close) == (variant.name == "chat")
    assert "variants: chat " in result.output  # the run's summary counts them (the Tally stats uses)
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["plan"]["mix"]["variants"]["chat"]["weight"] == 0.3 and manifest["plan"]["seed"] == 11

    report = invoke("verify-shard", str(out), "--json")
    errors = orjson.loads(report.output)["errors"]
    assert "prompt_mismatch" not in errors and "render_error" not in errors  # each record re-rendered with its kwargs

    stats = orjson.loads(invoke("stats", str(out), "--json").output)
    assert stats["variants"] == dict(sorted(Counter(r["variant"] for r in records).items()))


def test_resume_refuses_a_changed_mix_naming_the_field(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(8))
    out = tmp_path / "out"
    mix = mix_file(tmp_path)
    assert invoke("run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
                  "--server-url", fake_server.url, "--no-progress", "--mix", str(mix)).exit_code == 0  # fmt: skip
    mix.write_text(MIX_TOML.replace("weight = 0.3", "weight = 0.5"))
    refused = CliRunner().invoke(main, ["resume", "--out", str(out), "--server-url", fake_server.url])
    assert refused.exit_code == 2
    assert "mix.variants.chat.weight: pinned 0.3, now 0.5" in refused.output


@pytest.mark.slow
def test_the_draw_survives_kill_9_and_resume(
    tmp_path: Path, tiny_tokenizer: Path, fake_process: tuple[str, Path]
) -> None:
    url, _ = fake_process
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(300))
    mix = mix_file(tmp_path)
    out = tmp_path / "out"
    start = cli("run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
                  "--server-url", url, "--no-progress", "--concurrency", "2", "--checkpoint-records", "3",
                  "--max-new-tokens", "16", "--mix", str(mix), "--seed", "4", "--samples-per-prompt", "2")  # fmt: skip
    rng = random.Random(5)
    kills = 0
    for _ in range(8):
        if (out / "manifest.json").exists():
            command = cli("resume", "--out", str(out))
        else:  # killed before it wrote anything: start again
            shutil.rmtree(out, ignore_errors=True)
            command = start
        before = len(read_records_tolerant(out)) if (out / "shards").is_dir() else 0
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        # kill once this pass has written something (start-up time varies with the machine's load)
        while process.poll() is None and time.monotonic() < deadline:
            if (out / "shards").is_dir() and len(read_records_tolerant(out)) > before + 20:
                break
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 0.5))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
        if process.returncode == 0 or kills >= 3:
            break
    assert kills >= 2, f"only {kills} kills landed mid-run"
    assert len(read_records_tolerant(out)) < 600
    final = subprocess.run(cli("resume", "--out", str(out)), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    records = read_records(out)
    assert len(records) == len({r["id"] for r in records}) == 600
    loaded = load_mix(mix, seed=4)
    assert loaded is not None
    assert all(r["variant"] == loaded.choose(r["key"], r["sample"]).name for r in records)
    share = Counter(r["variant"] for r in records)["thinking"] / 600
    assert 0.6 < share < 0.8
