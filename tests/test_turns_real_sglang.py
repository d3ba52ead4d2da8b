"""``--turns all`` against a real SGLang 0.5.23 server on CPU, for a Kimi-style and a Qwen-style (chatml) template.

The scripted tool-call models (tests/real_sglang.py) reply reasoning, ``</think>``, "Checking Paris." and one
``get_weather`` call to every turn. Each turn's record is checked against what this test builds alone from the
source rows: the history with the earlier replies as SGLang's parsers split them (ids by the parser's rule, the
source's tool results spliced with the generated ids), rendered by transformers as SGLang's serving path hands
history to the template (arguments parsed into objects, ``"index": None`` per call); its output against
transformers' greedy on the same prompt. Then a run killed with SIGKILL in the middle of its conversations and
resumed gives the records of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from conftest import read_records, served_tools, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.inputs.prompts import parse_row
from eagle_datagen.record.turns import plan_turns
from eagle_datagen.server.parsers import parse_reply, reply_text
from eagle_datagen.testing.tiny import TOOL_CALL_MARKUP, Template, script_ids, tool_script
from real_sglang import SGLangServer, hf_greedy

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES: list[Template] = ["kimi", "chatml"]
MAX_NEW_TOKENS = 40
Message = dict[str, Any]
GET_TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def source_call(name: str, arguments: dict[str, Any], call_id: str) -> Message:
    """A source assistant turn that calls one tool (it is dropped: the model's own turn replaces it)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def tool_result(call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def rows(template: Template) -> list[dict[str, Any]]:
    """Four conversations: calls paired with the source's results for 3 turns; paired, then a user turn where the
    source has no results for the next call; a source that called another function; plain chat with no tools."""
    weather = tool_script(template).tools
    paris = {"city": "Paris"}
    return [
        {"id": "paired", "tools": weather, "messages": [
            user("Weather in Paris?"), source_call("get_weather", paris, "src0"), tool_result("src0", '{"temp_c": 21}'),
            source_call("get_weather", paris, "src1"), tool_result("src1", '{"temp_c": 19}'),
            {"role": "assistant", "content": "Mild: 19 to 21 C."},
        ]},
        {"id": "then_user", "tools": weather, "messages": [
            {"role": "system", "content": "Be brief."}, user("Weather in Paris?"),
            source_call("get_weather", paris, "src0"), tool_result("src0", '{"temp_c": 21}'),
            user("And tomorrow?"), {"role": "assistant", "content": "Probably rain."}, user("Thanks!"),
        ]},
        {"id": "other_tool", "tools": [*weather, GET_TIME], "messages": [
            user("What time is it in Paris?"), source_call("get_time", {"tz": "Europe/Paris"}, "src0"),
            tool_result("src0", '"14:05"'), user("Thanks."),
        ]},
        {"id": "no_tools", "messages": [user("Hello!"), {"role": "assistant", "content": "Hi."}, user("How are you?")]},
    ]  # fmt: skip


def call_id(template: Template, rid: str, earlier_calls: int) -> str:
    """The id SGLang's serving path gives the call (kimi_k2: ``functions.{name}:{n}``, n counting the earlier calls
    of the conversation); other parsers' ids are random there, so eagle-datagen's are ``call_{record id}_{index}``."""
    return f"functions.get_weather:{earlier_calls}" if template == "kimi" else f"call_{rid}_0"


def reply(template: Template, rid: str, earlier_calls: int, *, with_tools: bool = True) -> Message:
    """The scripted reply of turn ``rid`` as SGLang's parsers split it (measured in test_tool_script_real_sglang)."""
    script = tool_script(template)
    if not with_tools:  # no tools, no tool-call parse: the markup stays in the answer
        return {"role": "assistant", "content": script.answer + TOOL_CALL_MARKUP[template],
                "reasoning_content": script.reasoning}  # fmt: skip
    call = {"id": call_id(template, rid, earlier_calls), "type": "function",
            "function": {"name": script.call_name, "arguments": script.call_arguments}}  # fmt: skip
    return {"role": "assistant", "content": script.answer, "reasoning_content": script.reasoning, "tool_calls": [call]}


def expected_turns(template: Template) -> dict[str, list[tuple[list[Message], Message, str | None]]]:
    """Per conversation: each turn's messages (what its prompt is rendered from), its reply and its end, written
    out from the rows (the source's assistant turns dropped, the earlier replies and spliced results in)."""
    source = {row["id"]: row["messages"] for row in rows(template)}
    out: dict[str, list[tuple[list[Message], Message, str | None]]] = {}

    p = source["paired"]
    r1, r2, r3 = (reply(template, f"paired@t{k}", k - 1) for k in (1, 2, 3))
    m1 = [p[0]]
    m2 = [*m1, r1, tool_result(r1["tool_calls"][0]["id"], '{"temp_c": 21}')]
    m3 = [*m2, r2, tool_result(r2["tool_calls"][0]["id"], '{"temp_c": 19}')]
    out["paired"] = [(m1, r1, None), (m2, r2, None), (m3, r3, "complete")]

    u = source["then_user"]
    r1, r2 = reply(template, "then_user@t1", 0), reply(template, "then_user@t2", 1)
    m1 = u[:2]
    m2 = [*m1, r1, tool_result(r1["tool_calls"][0]["id"], '{"temp_c": 21}'), u[4]]
    out["then_user"] = [(m1, r1, None), (m2, r2, "tool_results_missing")]

    o = source["other_tool"]
    out["other_tool"] = [([o[0]], reply(template, "other_tool@t1", 0), "tool_calls_differ")]

    n = source["no_tools"]
    r1, r2 = (reply(template, f"no_tools@t{k}", 0, with_tools=False) for k in (1, 2))
    out["no_tools"] = [([n[0]], r1, None), ([n[0], r1, n[2]], r2, "complete")]
    return out


def served(message: Message) -> Message:
    """A history message as SGLang's chat path hands it to the template: tool-call arguments parsed into objects,
    each call dumped by its pydantic ``ToolCall`` (``"index": None``); see test_parsers_real_sglang."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {"id": c["id"], "index": None, "type": c["type"],
         "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]  # fmt: skip
    return {**message, "tool_calls": calls}


def render(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [served(m) for m in messages], tools=served_tools(tools), add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


@pytest.fixture(scope="module")
def expected(tool_kimi_model: Path, tool_chatml_model: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per template and record id: messages, reply, end, the independent render and transformers' greedy on it
    (computed before this module asks for a server: 2 cores)."""
    models: dict[Template, Path] = {"kimi": tool_kimi_model, "chatml": tool_chatml_model}
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for template, model in models.items():
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        tools = {row["id"]: row.get("tools") for row in rows(template)}
        records: dict[str, Any] = {}
        for base, turns in expected_turns(template).items():
            for k, (messages, parsed, end) in enumerate(turns, start=1):
                records[f"{base}@t{k}"] = {
                    "conversation": base, "turn": k, "messages": messages, "reply": parsed, "end": end,
                    "prompt_ids": render(tokenizer, messages, tools[base]),
                }  # fmt: skip
        prompts = sorted({tuple(r["prompt_ids"]) for r in records.values()})
        greedy = dict(zip(prompts, hf_greedy(model, prompts, MAX_NEW_TOKENS), strict=True))
        for record in records.values():
            record["output_ids"] = greedy[tuple(record["prompt_ids"])]
        out[template] = records
    return out


def run_args(prompts: Path, out: Path, model: Path, server: SGLangServer, template: Template) -> list[str]:
    script = tool_script(template)
    return [
        "run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(model), "--server-url", server.url,
        "--no-progress", "--max-new-tokens", str(MAX_NEW_TOKENS), "--turns", "all",
        "--reasoning-parser-name", script.reasoning_parser, "--tool-call-parser-name", script.tool_call_parser,
    ]  # fmt: skip


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("template", TEMPLATES)
def test_every_turn_renders_from_the_parsed_replies_and_is_transformers_greedy(
    tmp_path: Path, template: Template, expected: dict[str, dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    model: Path = request.getfixturevalue(f"tool_{template}_model")
    server: SGLangServer = request.getfixturevalue(f"tool_{template}_server")
    source = rows(template)
    prompts = write_jsonl(tmp_path / "convs.jsonl", source)
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, model, server, template))
    assert result.exit_code == 0, result.output
    want: dict[str, dict[str, Any]] = expected[template]
    records = {r["id"]: r for r in read_records(out)}
    assert sorted(records) == sorted(want)  # 3, 2, 1 and 2 turns
    chain = script_ids(model, "tool_call")
    for rid, record in records.items():
        w = want[rid]
        assert (record["conversation"], record["turn"], record["end"]) == (w["conversation"], w["turn"], w["end"]), rid
        assert record["messages"] == w["messages"], rid  # the history, with the generated call ids spliced
        assert record["reply"] == w["reply"], rid
        assert record["prompt_ids"] == w["prompt_ids"], rid  # an independent transformers render
        assert record["output_ids"] == w["output_ids"] == chain[1:], rid  # transformers greedy, the script
        assert record["finish_reason"]["type"] == "stop"
    # The spliced results answer the generated ids (the Kimi template prints them: "## Return of functions...").
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    third = tokenizer.decode(records["paired@t3"]["prompt_ids"], skip_special_tokens=False)
    first_id = records["paired@t1"]["reply"]["tool_calls"][0]["id"]
    assert first_id in third and "src0" not in third
    if template == "kimi":
        assert "## Return of functions.get_weather:1\n" in third

    ends = {e["base"]: (e["turns"], e["end"]) for e in map(orjson.loads, (out / "conversations.jsonl").read_bytes().splitlines())}  # fmt: skip
    assert ends == {"paired": (3, "complete"), "then_user": (2, "tool_results_missing"),
                    "other_tool": (1, "tool_calls_differ"), "no_tools": (2, "complete")}  # fmt: skip

    # The server's own renderer (its serving chat path) gives the recorded prompt of the richest turn.
    tools = source[0]["tools"]
    served_render = httpx.post(
        f"{server.url}/v1/tokenize", timeout=60,
        json={"model": "default", "messages": records["paired@t3"]["messages"], "tools": tools,
              "add_generation_prompt": True},
    )  # fmt: skip
    assert served_render.status_code == 200, served_render.text
    assert served_render.json()["tokens"] == records["paired@t3"]["prompt_ids"]

    # The live parsers split turn 2's output into its recorded reply (the id counts turn 1's call).
    second = records["paired@t2"]
    script = tool_script(template)
    text = reply_text(tokenizer, second["output_ids"], [tokenizer.eos_token_id], opened_by_prompt="<think>")

    async def parse() -> Message:
        async with httpx.AsyncClient(timeout=60) as http:
            parsed = await parse_reply(
                http, server.url, text, reasoning_parser=script.reasoning_parser,
                tool_call_parser=script.tool_call_parser, tools=tools, call_id=lambda i: f"call_paired@t2_{i}",
                earlier_calls=1,
            )  # fmt: skip
            return parsed.message()

    assert asyncio.run(parse()) == second["reply"]

    verified = invoke("verify-shard", str(out))
    assert verified.exit_code == 0, verified.output


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle_datagen", *args]


def lines_on_disk(out: Path) -> list[dict[str, Any]]:
    """The complete record lines written so far (a line being written may be torn)."""
    found = []
    for path in sorted((out / "shards").glob("shard_*.jsonl*")) if (out / "shards").exists() else []:
        data = path.read_bytes()
        found += [orjson.loads(line) for line in data.splitlines()[: data.count(b"\n")]]
    return found


def cut_mid_conversation(records: list[dict[str, Any]]) -> bool:
    """A few turns are durable, and some conversation has turns on disk but not its last."""
    turns: dict[str, set[int]] = {}
    for record in records:
        turns.setdefault(record["conversation"], set()).add(record["turn"])
    return len(records) >= 8 and any(3 not in t for t in turns.values())


@pytest.mark.sglang
@pytest.mark.slow
def test_kill_9_in_the_middle_of_conversations_then_resume_gives_an_uninterrupted_runs_records(
    tmp_path: Path, tool_kimi_model: Path, tool_kimi_server: SGLangServer
) -> None:
    paired = rows("kimi")[0]
    source = []
    for i in range(24):
        row = copy.deepcopy(paired)
        row["id"] = f"w{i}"
        row["messages"][0]["content"] = f"Weather in Paris, question {i}?"
        source.append(row)
    prompts = write_jsonl(tmp_path / "convs.jsonl", source)
    whole = tmp_path / "whole"
    result = invoke(*run_args(prompts, whole, tool_kimi_model, tool_kimi_server, "kimi"), "--concurrency", "4")
    assert result.exit_code == 0, result.output
    want = sorted(read_records(whole), key=lambda r: r["id"])
    assert len(want) == 72

    cut = tmp_path / "cut"
    process = subprocess.Popen(
        cli(*run_args(prompts, cut, tool_kimi_model, tool_kimi_server, "kimi"), "--concurrency", "4"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    try:
        while not cut_mid_conversation(lines_on_disk(cut)):
            if process.poll() is not None:
                pytest.fail(f"the run ended before the kill ({process.returncode}): "
                            f"{process.communicate()[1].decode()[-2000:]}")  # fmt: skip
            assert time.monotonic() < deadline, "no conversation under way after 180 s"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL
    partial = lines_on_disk(cut)
    assert cut_mid_conversation(partial) and len(partial) < len(want)

    resumed = subprocess.run(cli("resume", "--out", str(cut), "--no-progress"), capture_output=True, text=True,
                             timeout=300, check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got = sorted(read_records(cut), key=lambda r: r["id"])
    assert [r["id"] for r in got] == [r["id"] for r in want]  # every turn once
    assert got == want
    verified = invoke("verify-shard", str(cut))
    assert verified.exit_code == 0, verified.output


def test_the_demo_conversations_are_valid_rows_with_the_turns_the_demo_prints() -> None:
    """examples/conversations.jsonl (``make demo``'s multi-turn run): every row parses, and the turns each can
    reach (one per source assistant turn, plus the last) stay what the demo's text describes."""
    path = ROOT / "examples" / "conversations.jsonl"
    turns = {}
    for line, raw in enumerate(path.read_bytes().splitlines(), start=1):
        row = parse_row(raw, str(path), line)
        turns[row.key] = plan_turns(row.messages, str(path), line).turns
    assert turns == {"chat-00": 3, "chat-01": 2, "weather-00": 3, "weather-01": 3, "weather-then-chat": 3,
                     "other-tool": 2}  # fmt: skip
