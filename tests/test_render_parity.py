"""Render parity and --render server against the fake server's /v1/tokenize; the pinned date through run,
resume and verify-shard (gpt-oss)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.inputs.prompts import parse_row
from eagle_datagen.inputs.render import Renderer, load_tokenizer
from eagle_datagen.server.parity import describe_difference, row_shapes, sample_rows
from eagle_datagen.server.tokenize import ServerRenderer
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config

REAL = Path(__file__).resolve().parents[2] / "shared" / "real-tokenizers"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_args(prompts: Path, out: Path, tokenizer: Path, url: str, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer), "--server-url", url,
            "--no-progress", "--max-new-tokens", "16", *extra]  # fmt: skip


def fake(tokenizer: Path, **changes: Any) -> FakeSGLangServer:
    tok = load_tokenizer(tokenizer, trust_remote_code=True)
    config = FakeConfig(vocab_size=len(tok), eos_id=tok.eos_token_id, tokenizer_path=str(tokenizer),
                        **{"family": family_config(tok), **changes})  # fmt: skip
    return FakeSGLangServer(config)


def test_the_sample_covers_every_row_shape_present(tmp_path: Path) -> None:
    rows = varied_rows(40)
    rows.append(
        {"id": "late-system", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    )
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(50)] + rows)
    sample = sample_rows(prompts, 4)
    shapes = set().union(*(row_shapes(r) for r in sample))
    assert shapes >= {"single_turn", "system", "multi_turn", "tools", "text_parts"}
    assert len(sample) == 4 and [r.line for r in sample] == sorted(r.line for r in sample)
    assert len(sample_rows(prompts, 32)) == 32


def test_a_difference_reads_as_position_and_both_tokens(tiny_tokenizer: Path) -> None:
    tok = load_tokenizer(tiny_tokenizer)
    client = tok.encode("hello world again", add_special_tokens=False)
    server = [*client[:1], tok.convert_tokens_to_ids("<think>"), *client[1:]]
    text = describe_difference(tok, client, server)
    assert text.startswith(f"they differ at position 1 ({len(client)} ids here, {len(server)} on the server)")
    assert "'<think>'" in text.splitlines()[2] and "server:" in text.splitlines()[2]


def test_a_server_rendering_with_another_template_stops_the_run_before_any_generate(
    tmp_path: Path, tiny_tokenizer: Path, chatml_tokenizer: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(12))
    other = load_tokenizer(chatml_tokenizer).chat_template
    with fake(tiny_tokenizer, chat_template=other) as server:
        result = invoke(*run_args(prompts, tmp_path / "a", tiny_tokenizer, server.url))
        assert result.exit_code == 1
        assert "render parity: " in result.output and "renders differently here and on" in result.output
        assert "--render server" in result.output and "--no-render-parity" in result.output
        assert server.stats()["generate_received"] == 0
        skipped = invoke(*run_args(prompts, tmp_path / "b", tiny_tokenizer, server.url, "--no-render-parity"))
        assert skipped.exit_code == 0, skipped.output
        assert "render parity" not in skipped.output


def test_render_server_records_the_servers_prompts(
    tmp_path: Path, tiny_tokenizer: Path, chatml_tokenizer: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(12))
    other = load_tokenizer(chatml_tokenizer).chat_template
    with fake(tiny_tokenizer, chat_template=other) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url, "--render", "server"))
        assert result.exit_code == 0, result.output
        with ServerRenderer(server.url) as renderer:
            expected = {
                row.key: renderer.tokenize(row)
                for row in (parse_row(orjson.dumps(r), "p", i) for i, r in enumerate(varied_rows(12), 1))
            }
    records = read_records(tmp_path / "out")
    assert records and all(r["prompt_ids"] == expected[r["key"]] for r in records)
    client = Renderer(load_tokenizer(tiny_tokenizer))
    assert any(r["prompt_ids"] != client.render(parse_row(orjson.dumps({"prompt": "x"}), "p", 1)) for r in records)
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert manifest["plan"]["render"] == {"renderer": "server", "date": None}


def test_parity_passes_against_the_same_template_and_is_reported(tmp_path: Path, tiny_tokenizer: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(40))
    with fake(tiny_tokenizer) as server:
        result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, server.url))
    assert result.exit_code == 0, result.output
    assert "sampled rows render identically (shapes: multi_turn, single_turn, system, text_parts, tools)" in (
        result.output
    )


def test_a_server_without_tokenize_is_a_warning(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(4))
    fake_server.update_config(tokenizer_path=None)
    result = invoke(*run_args(prompts, tmp_path / "out", tiny_tokenizer, fake_server.url))
    assert result.exit_code == 0, result.output
    assert "warning: render parity not checked: " in result.output and "has no /v1/tokenize" in result.output


@pytest.mark.skipif(not (REAL / "gpt-oss").is_dir(), reason="needs ../shared/real-tokenizers/gpt-oss")
def test_the_pinned_date_holds_through_run_resume_and_verify(tmp_path: Path) -> None:
    gpt_oss = REAL / "gpt-oss"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(6)])
    out = tmp_path / "out"
    with fake(gpt_oss) as server:
        result = invoke(*run_args(prompts, out, gpt_oss, server.url, "--render-date", "2025-03-04"))
        assert result.exit_code == 0, result.output
        assert "prompts render with 2025-03-04, pinned in the manifest" in result.output
        # parity compares with today's date (the server's clock), the records keep the pinned one
        assert "parity is checked with today's" in result.output
        again = CliRunner().invoke(main, ["resume", "--out", str(out), "--server-url", server.url, "--no-progress"])
        assert again.exit_code == 0, again.output  # the same plan: the date came from the manifest
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["plan"]["render"] == {"renderer": "client", "date": "2025-03-04"}
    tok = load_tokenizer(gpt_oss)
    assert all("Current date: 2025-03-04\n" in tok.decode(r["prompt_ids"]) for r in read_records(out))
    report = json.loads(CliRunner().invoke(main, ["verify-shard", str(out), "--json"]).output)
    assert "prompt_mismatch" not in report["errors"], report["errors"]
    assert datetime.date.today() != datetime.date(2025, 3, 4)  # so a render with today's date would differ


def test_verify_shard_with_server_url_renders_every_record_through_the_server(
    tmp_path: Path, tiny_tokenizer: Path, chatml_tokenizer: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(12))
    out = tmp_path / "out"
    with fake(tiny_tokenizer) as server:
        assert invoke(*run_args(prompts, out, tiny_tokenizer, server.url)).exit_code == 0
        same = CliRunner().invoke(main, ["verify-shard", str(out), "--json", "--server-url", server.url])
        assert same.exit_code == 0, same.output
        server.update_config(chat_template=load_tokenizer(chatml_tokenizer).chat_template)
        other = CliRunner().invoke(main, ["verify-shard", str(out), "--json", "--server-url", server.url])
    assert other.exit_code == 1
    report = json.loads(other.output)
    assert report["errors"]["render_error"]["count"] == len(read_records(out))
    example = report["errors"]["render_error"]["examples"][0]["message"]
    assert "render parity: " in example and "renders it differently; they differ at position" in example


def test_verify_of_a_server_rendered_run_needs_the_server(tmp_path: Path, tiny_tokenizer: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", varied_rows(6))
    out = tmp_path / "out"
    with fake(tiny_tokenizer) as server:
        assert invoke(*run_args(prompts, out, tiny_tokenizer, server.url, "--render", "server")).exit_code == 0
        there = CliRunner().invoke(main, ["verify-shard", str(out), "--json", "--server-url", server.url])
    assert there.exit_code == 0, there.output
    alone = json.loads(CliRunner().invoke(main, ["verify-shard", str(out), "--json"]).output)
    assert any("pass --server-url to re-render there" in s for s in alone["not_checked"])
