"""``eagle-datagen stats``: numbers equal a slow reference computation; plots, HTML, a real browser."""

from __future__ import annotations

import math
import random
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from eagle_datagen.cli import main
from eagle_datagen.report.markers import Markers
from eagle_datagen.report.stats import collect, split_output

THINK_OPEN, THINK_CLOSE, TOOL, EOS = 900, 901, 902, 903
VOCAB = 70_000


def _tokenizer_dir(tmp_path: Path) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir()
    decoder = {
        str(i): {"content": name, "special": False}
        for i, name in ((THINK_OPEN, "<think>"), (THINK_CLOSE, "</think>"), (TOOL, "<tool_call>"), (EOS, "<eos>"))
    }
    (tok / "tokenizer_config.json").write_text(orjson.dumps({"added_tokens_decoder": decoder}).decode())
    return tok


def _record(rng: random.Random, i: int, variant: str | None, now: float) -> dict[str, Any]:
    opens = variant != "chat"
    prompt = [rng.randrange(1000, VOCAB) for _ in range(rng.randrange(3, 60))]
    prompt += [THINK_OPEN] if opens else [THINK_OPEN, THINK_CLOSE]
    # a skewed id distribution, so the coverage numbers are not trivial
    body = [min(int(rng.paretovariate(0.6)) + 1000, VOCAB - 1) for _ in range(rng.randrange(0, 80))]
    kind = rng.random()
    output = list(body)
    if opens and kind < 0.6:
        output.insert(rng.randrange(0, len(output) + 1), THINK_CLOSE)
    if kind > 0.85:
        output.insert(rng.randrange(0, len(output) + 1), TOOL)
    length = rng.random() < 0.2
    if length:
        finish: dict[str, Any] = {"type": "length"}
        output = (output + [5000] * 100)[:100]
    else:
        output.append(EOS)
        finish = {"type": "stop", "matched": EOS}
    started = now + rng.uniform(0, 300)
    record: dict[str, Any] = {
        "id": f"r{i}",
        "key": f"r{i}",
        "sample": 0,
        "prompt_ids": prompt,
        "output_ids": output,
        "finish_reason": finish,
        "completion_tokens": len(output),
        "started": round(started, 3),
        "finished": round(started + rng.uniform(0.1, 20), 3),
        "server": f"http://node{i % 3}:30000",
    }
    if variant is not None:
        record["variant"] = variant
    if i % 7 == 0:
        record["turn"] = i % 3
    return record


def _make_run(tmp_path: Path, n: int = 3000) -> tuple[Path, list[dict[str, Any]]]:
    rng = random.Random(11)
    out = tmp_path / "run"
    (out / "shards").mkdir(parents=True)
    tok = _tokenizer_dir(tmp_path)
    manifest = {
        "format": 1,
        "plan": {"tokenizer": {"path": str(tok)}, "sampling_params": {"max_new_tokens": 100}},
        "facts": {
            "think_open_id": THINK_OPEN,
            "think_close_id": THINK_CLOSE,
            "eos_token_ids": [EOS],
            "vocab_size": VOCAB,
        },
        "runs": [{"command": "run", "started": "2026-12-01T00:00:00Z"}],  # no "finished": a live run
    }
    (out / "manifest.json").write_bytes(orjson.dumps(manifest))
    records = [_record(rng, i, rng.choice(["thinking", "thinking", "chat"]), 1.76e9) for i in range(n)]
    lines = [orjson.dumps(r) + b"\n" for r in records]
    # a few lines in another layout (indented, keys reordered): the slow path must agree
    for j in range(0, n, 97):
        reordered = dict(reversed(list(records[j].items())))
        lines[j] = orjson.dumps(reordered, option=orjson.OPT_INDENT_2).replace(b"\n", b" ") + b"\n"
    third = n // 3
    (out / "shards" / "shard_00000.jsonl").write_bytes(b"".join(lines[:third]))
    (out / "shards" / "shard_00001.jsonl").write_bytes(b"".join(lines[third : 2 * third]))
    # the live shard: complete lines, then a torn one that must not be read
    torn = lines[2 * third][: len(lines[2 * third]) // 2]
    (out / "shards" / "shard_00002.jsonl.partial").write_bytes(b"".join(lines[2 * third + 1 :]) + torn)
    kept = records[: 2 * third] + records[2 * third + 1 :]
    return out, kept


def _nearest_rank(values: list[int]) -> dict[str, int]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    out = {f"p{p}": ordered[max(0, math.ceil(p * len(ordered) / 100) - 1)] for p in (50, 90, 99)}
    out["max"] = ordered[-1]
    return out


def _reference(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything computed the slow, obvious way over parsed records."""
    reasoning_lengths, answers = [], []
    reasoning_tokens = unclosed = empty = tools = 0
    for r in records:
        out = r["output_ids"]
        opened = r["prompt_ids"][-1] == THINK_OPEN
        close = out.index(THINK_CLOSE) if THINK_CLOSE in out else None
        tool = out.index(TOOL) if TOOL in out else None
        end = len(out) - (1 if r["finish_reason"]["type"] == "stop" else 0)
        if close is not None:
            reasoning, start = close, close + 1
        elif opened:
            reasoning = tool if tool is not None else end
            start = reasoning
        else:
            reasoning = start = 0
        is_tool = tool is not None and tool >= start
        if is_tool:
            end = tool
        answer = max(0, end - start)
        if reasoning:
            reasoning_lengths.append(reasoning)
            reasoning_tokens += reasoning
            unclosed += close is None
        answers.append(answer)
        tools += is_tool
        empty += r["finish_reason"]["type"] == "stop" and answer == 0 and not is_tool
    counts = Counter(t for r in records for t in r["output_ids"])
    ranked = sorted(counts.values(), reverse=True)
    total = sum(ranked)
    prefix = [0]
    for c in ranked:
        prefix.append(prefix[-1] + c)
    ids_for = {str(q): next(n for n in range(1, len(ranked) + 1) if prefix[n] * 100 >= q * total) for q in (90, 95, 99)}
    top = {str(k): round(prefix[min(k, len(ranked))] / total, 6) for k in (8192, 16384, 32768, 65536)}
    tokens = sum(len(r["output_ids"]) for r in records)
    first = min(r["started"] for r in records)
    last = max(r["finished"] for r in records)
    per_server = {}
    for url in sorted({r["server"] for r in records}):
        mine = [r for r in records if r["server"] == url]
        span = max(r["finished"] for r in mine) - min(r["started"] for r in mine)
        per_server[url] = (
            len(mine),
            sum(len(r["output_ids"]) for r in mine),
            round(sum(len(r["output_ids"]) for r in mine) / span, 1),
        )
    return {
        "records": len(records),
        "finish": dict(sorted(Counter(r["finish_reason"]["type"] for r in records).items())),
        "variants": dict(sorted(Counter(r.get("variant", "-") for r in records).items())),
        "turns": dict(sorted(Counter(str(r.get("turn", 0)) for r in records).items())),
        "servers": dict(sorted(Counter(r["server"] for r in records).items())),
        "output": _nearest_rank([len(r["output_ids"]) for r in records]),
        "prompt": _nearest_rank([len(r["prompt_ids"]) for r in records]),
        "hit": sum(r["finish_reason"]["type"] == "length" for r in records),
        "reasoning_length": _nearest_rank(reasoning_lengths),
        "reasoning_tokens": reasoning_tokens,
        "unclosed": unclosed,
        "answer": _nearest_rank(answers),
        "empty": empty,
        "tools": tools,
        "coverage": {"distinct_ids": len(ranked), "tokens": total, "top": top, "ids_for": ids_for},
        "tok_s": round(tokens / (last - first), 1),
        "per_server": per_server,
        "by_variant_output": {
            v: _nearest_rank([len(r["output_ids"]) for r in records if r.get("variant", "-") == v])
            for v in sorted({r.get("variant", "-") for r in records})
        },
    }


def test_stats_equal_a_slow_reference(tmp_path: Path) -> None:
    out, records = _make_run(tmp_path)
    got = collect(out).to_json()
    want = _reference(records)
    assert got["records"] == want["records"] == 2999
    for name in ("finish", "variants", "turns", "servers"):
        assert got[name] == want[name], name
    assert {k: got["output_tokens"][k] for k in ("p50", "p90", "p99", "max")} == want["output"]
    assert got["prompt_tokens"] == want["prompt"]
    assert got["hit_max_new_tokens"]["count"] == want["hit"]
    assert got["reasoning"]["length"] == want["reasoning_length"]
    assert got["reasoning"]["tokens"] == want["reasoning_tokens"]
    assert got["reasoning"]["unclosed"] == want["unclosed"]
    assert got["answer"] == {"length": want["answer"], "empty": want["empty"]}
    assert got["tool_call_turns"] == want["tools"]
    assert got["coverage"] == want["coverage"]
    assert got["throughput"]["tok_s"] == want["tok_s"]
    servers = {u: (s["records"], s["output_tokens"], s["tok_s"]) for u, s in got["throughput"]["per_server"].items()}
    assert servers == want["per_server"]
    assert sum(b["records"] for b in got["throughput"]["bins"]) == 2999
    assert {
        v: {k: d["output_tokens"][k] for k in ("p50", "p90", "p99", "max")} for v, d in got["by_variant"].items()
    } == want["by_variant_output"]
    assert got["live"] is True
    assert any("shard_00002.jsonl.partial: its last line is incomplete" in n for n in got["notes"])
    assert any("only complete lines were read" in n for n in got["notes"])


def test_split_output_rule() -> None:
    # reasoning, think-close, answer, stop id
    assert split_output(10, 4, None, opens_reasoning=True, ends_on_stop_id=True).__dict__ == {
        "reasoning": 4, "closed": True, "answer": 4, "tool_call": False}  # fmt: skip
    # cut by max_new_tokens inside reasoning: all reasoning, no answer
    assert split_output(10, None, None, opens_reasoning=True, ends_on_stop_id=False).answer == 0
    # a tool call after the answer
    shape = split_output(10, 2, 6, opens_reasoning=True, ends_on_stop_id=True)
    assert (shape.reasoning, shape.answer, shape.tool_call) == (2, 3, True)
    # thinking off: everything but the stop id is answer
    assert split_output(5, None, None, opens_reasoning=False, ends_on_stop_id=True).answer == 4
    markers = Markers(think_open=1, think_close=2)
    assert markers.prompt_opens_reasoning([7, 1]) and markers.prompt_opens_reasoning([1, 9])
    assert not markers.prompt_opens_reasoning([1, 2]) and not markers.prompt_opens_reasoning([1, 9, 9])


def test_cli_text_json_plots_and_html(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots extra: pip install 'eagle-datagen[plots]'")
    out, _ = _make_run(tmp_path, n=600)
    plots, html = tmp_path / "plots", tmp_path / "report.html"
    result = CliRunner().invoke(main, ["stats", str(out), "--plots", str(plots), "--html", str(html)])
    assert result.exit_code == 0, result.output
    assert "599 records in 3 shard file(s) (1 still being written)" in result.output
    assert "note: a run is writing here (or was killed): only complete lines were read" in result.output
    assert "ids needed to cover: 90 %" in result.output
    for name in ("lengths", "finish", "coverage", "throughput"):
        data = (plots / f"{name}.png").read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    page = html.read_text()
    assert page.count("data:image/png;base64,") == 4 and "id='coverage'" in page
    as_json = CliRunner().invoke(main, ["stats", str(out), "--json"])
    assert orjson.loads(as_json.output)["records"] == 599


def test_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["stats", str(tmp_path)])
    assert result.exit_code == 2
    assert "has no manifest.json: give the --out directory of an eagle-datagen run" in result.output


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no chromium on this machine: apt-get install -y chromium")
def test_the_html_opens_in_headless_chromium_and_shows_the_coverage_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots extra: pip install 'eagle-datagen[plots]'")
    import numpy as np
    from matplotlib.image import imread

    out, _ = _make_run(tmp_path, n=600)
    html = tmp_path / "report.html"
    assert CliRunner().invoke(main, ["stats", str(out), "--html", str(html)]).exit_code == 0
    shot = tmp_path / "shot.png"
    browser = _chromium()
    assert browser is not None
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
         "--window-size=1200,5000", "--user-data-dir=" + str(tmp_path / "profile"), html.as_uri()],
        check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    pixels = imread(str(shot))[:, :, :3]
    # the coverage curve is the only thing drawn in #C44E52 (196, 78, 82): the plot rendered on the page
    red = np.all(np.abs(pixels - np.array([196, 78, 82]) / 255) < 0.04, axis=2)
    assert red.sum() > 200, "the coverage curve is not on the screenshot"
