"""``--turns all`` end to end against the fake SGLang server (its /generate shaped as the tiny Kimi-style family
writes, its parser endpoints on text): every turn once, history built from the parsed replies, resume, verify."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.inputs.render import load_tokenizer
from eagle_datagen.testing import fake_parsers
from eagle_datagen.testing.fake_sglang import expected_output


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_args(prompts: Path, out: Path, tokenizer: Path, server: Any, *extra: str) -> list[str]:
    return [
        "run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
        "--server-url", server.url, "--no-progress", "--turns", "all", "--reasoning-parser-name", "kimi_k2",
        "--max-new-tokens", "128", *extra,
    ]  # fmt: skip


def conversation(i: int, users: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
    for u in range(users):
        messages.append({"role": "user", "content": f"question {u} of conversation {i}"})
        if u < users - 1 or i % 2:  # odd rows end with the source's own reply (dropped: it is regenerated)
            messages.append({"role": "assistant", "content": f"source answer {u}"})
    return {"id": f"c{i}", "messages": messages}


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def parsed(tokenizer: Any, prompt_ids: list[int], output_ids: list[int], stop: int) -> dict[str, Any]:
    """What SGLang's kimi_k2 reasoning parser makes of an output (the fake's table is checked against the real one)."""
    ids = output_ids[:-1] if output_ids and output_ids[-1] == stop else output_ids
    opener = "<think>" if prompt_ids[-1] == tokenizer.convert_tokens_to_ids("<think>") else ""
    text = opener + tokenizer.decode(ids, skip_special_tokens=False)
    split = fake_parsers.separate_reasoning({"text": text, "reasoning_parser": "kimi_k2"})
    reply = {"role": "assistant", "content": split["text"]}
    if split["reasoning_text"]:  # serving reports an empty reasoning as null: the message has none
        reply["reasoning_content"] = split["reasoning_text"]
    return reply


def test_every_turn_once_each_rendered_from_the_parsed_replies_before_it(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    rows = [conversation(i, 1 + i % 4) for i in range(24)]
    prompts = write_jsonl(tmp_path / "convs.jsonl", rows)
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server))
    assert result.exit_code == 0, result.output
    records = read_records(out)
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records) == sum(1 + i % 4 for i in range(24))
    tokenizer = load_tokenizer(tiny_tokenizer)
    stop = fake_server.config.eos_id
    sampling = {"max_new_tokens": 128, "temperature": 0.0}
    for i, row in enumerate(rows):
        turns = 1 + i % 4
        source_users = [m for m in row["messages"] if m["role"] == "user"]
        history = [m for m in row["messages"][:1] if m["role"] == "system"]
        for k in range(1, turns + 1):
            record = by_id[f"c{i}@t{k}"]
            assert (record["conversation"], record["turn"], record["key"], record["sample"]) == (f"c{i}", k, f"c{i}", 0)
            history = [*history, source_users[k - 1]]
            assert record["messages"] == history  # the source's own replies never appear
            assert record["prompt_ids"] == render(tokenizer, history)  # an independent render
            assert record["output_ids"] == expected_output(fake_server.config, record["prompt_ids"], sampling)
            reply = parsed(tokenizer, record["prompt_ids"], record["output_ids"], stop)
            assert record["reply"] == reply and reply["reasoning_content"]
            assert record["end"] == ("complete" if k == turns else None)
            history = [*history, reply]
    ends = [orjson.loads(line) for line in (out / "conversations.jsonl").read_bytes().splitlines()]
    assert sorted(e["base"] for e in ends) == sorted(r["id"] for r in rows)
    assert {e["end"] for e in ends} == {"complete"}
    assert "conversations ended this pass: 24 (24 complete)" in result.output

    verified = invoke("verify-shard", str(out), "--json")
    report = json.loads(verified.output)
    assert verified.exit_code == 0, verified.output
    assert report["records"] == len(records)


def test_verify_catches_a_changed_history_a_missing_turn_and_a_wrong_end(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 3) for i in range(4)])
    out = tmp_path / "out"
    assert invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--shard-size", "100")).exit_code == 0
    shard = next((out / "shards").glob("shard_*.jsonl"))
    lines = shard.read_bytes().splitlines()
    records = [orjson.loads(line) for line in lines]
    edited = []
    for record in records:
        if record["id"] == "c0@t2":  # a reply that is not what the model wrote
            record["messages"][1]["content"] = "something else"
        if record["id"] == "c1@t2":
            continue  # a missing middle turn
        if record["id"] == "c2@t3":
            record["end"] = "truncated"
        edited.append(orjson.dumps(record))
    shard.write_bytes(b"\n".join(edited) + b"\n")
    result = invoke("verify-shard", str(out), "--json")
    assert result.exit_code == 1
    errors = json.loads(result.output)["errors"]
    found = {(kind, f["id"]) for kind, entry in errors.items() for f in entry["examples"]}
    assert {("turn_history", "c0@t3"), ("turn_missing", "c1@t3"), ("turn_end", "c2@t3")} <= found, found
    assert ("prompt_mismatch", "c0@t2") in found  # its prompt no longer renders from its messages


def test_kill_in_the_middle_and_resume_gives_the_same_records(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    rows = [conversation(i, 2 + i % 3) for i in range(30)]
    prompts = write_jsonl(tmp_path / "convs.jsonl", rows)
    whole = tmp_path / "whole"
    assert invoke(*run_args(prompts, whole, tiny_tokenizer, fake_server)).exit_code == 0
    expected = sorted(read_records(whole), key=lambda r: r["id"])

    # the same run stopped after a few records (SIGINT to ourselves once some turns are durable), then resumed
    cut = tmp_path / "cut"
    fake_server.update_config(latency_s=0.02)
    import threading

    def stop_soon() -> None:
        import os
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shards = list((cut / "shards").glob("shard_*.jsonl*")) if (cut / "shards").exists() else []
            if sum(p.read_bytes().count(b"\n") for p in shards) >= 15:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    threading.Thread(target=stop_soon, daemon=True).start()
    first = invoke(*run_args(prompts, cut, tiny_tokenizer, fake_server, "--grace-period-s", "0"))
    assert first.exit_code == 130, first.output
    partial = read_records(cut)
    assert 15 <= len(partial) < len(expected)
    fake_server.update_config(latency_s=0.0)
    second = invoke("resume", "--out", str(cut), "--no-progress")
    assert second.exit_code == 0, second.output
    assert "to continue from their last turn" in second.output
    assert sorted(read_records(cut), key=lambda r: r["id"]) == expected


def test_a_truncated_turn_ends_its_conversation_unless_asked_to_go_on(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 3) for i in range(20)])
    out = tmp_path / "out"
    result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--max-new-tokens", "40"))
    assert result.exit_code == 0, result.output
    records = read_records(out)
    truncated = [r for r in records if r["finish_reason"]["type"] == "length"]
    assert truncated and all(r["end"] == "truncated" for r in truncated)
    assert all(r["end"] in (None, "complete") for r in records if r["finish_reason"]["type"] != "length")
    assert f"stopped early: truncated {len(truncated)}" in result.output
    assert invoke("verify-shard", str(out)).exit_code == 0
    going_on = tmp_path / "going-on"
    result = invoke(
        *run_args(prompts, going_on, tiny_tokenizer, fake_server, "--max-new-tokens", "40",
                  "--on-truncated-turn", "continue")
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(read_records(going_on)) == 60
    assert invoke("verify-shard", str(going_on)).exit_code == 0


@pytest.mark.parametrize("flag", ["--reasoning-parser-name"])
def test_a_reasoning_model_without_its_parser_is_refused_before_anything_is_sent(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, flag: str
) -> None:
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(0, 2)])
    args = [a for a in run_args(prompts, tmp_path / "out", tiny_tokenizer, fake_server) if a not in (flag, "kimi_k2")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "--reasoning-parser-name" in result.output
    # the advice, followed literally: `none` keeps the whole reply as the answer
    followed = invoke(*args, "--reasoning-parser-name", "none")
    assert followed.exit_code == 0, followed.output
    assert all("reasoning_content" not in r["reply"] for r in read_records(tmp_path / "out"))
    bad = run_args(prompts, tmp_path / "out2", tiny_tokenizer, fake_server)
    bad[bad.index("kimi_k2")] = "no_such_parser"
    result = CliRunner().invoke(main, bad)
    assert result.exit_code == 1 and "parser" in result.output, result.output


def test_partitions_of_conversations_merge_and_verify(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    """All turns of a conversation hash to one partition; merge counts a conversation there once it ended."""
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 1 + i % 3) for i in range(30)])
    single = tmp_path / "single"
    assert invoke(*run_args(prompts, single, tiny_tokenizer, fake_server)).exit_code == 0
    parts = [tmp_path / f"part{i}" for i in range(2)]
    for i, out in enumerate(parts):
        result = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--partition", f"{i}/2"))
        assert result.exit_code == 0, result.output
    merged = tmp_path / "merged"
    result = invoke("merge", str(merged), *map(str, parts))
    assert result.exit_code == 0, result.output
    assert {r["id"]: r for r in read_records(merged)} == {r["id"]: r for r in read_records(single)}
    assert len((merged / "conversations.jsonl").read_bytes().splitlines()) == 30
    assert invoke("verify-shard", str(merged)).exit_code == 0

    # a conversation that has not ended is missing, even though its first turns are there
    ends = parts[0] / "conversations.jsonl"
    lines = ends.read_bytes().splitlines()
    ends.write_bytes(b"\n".join(lines[1:]) + b"\n")
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "merged2"), *map(str, parts)])
    assert result.exit_code == 2 and "incomplete" in result.output, result.output


def test_export_and_stats_read_turn_records(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 3) for i in range(6)])
    out = tmp_path / "out"
    assert invoke(*run_args(prompts, out, tiny_tokenizer, fake_server)).exit_code == 0
    stats = invoke("stats", str(out))
    assert stats.exit_code == 0, stats.output
    exported = invoke("export", str(out), "--out", str(tmp_path / "sf"), "--format", "specforge", "--merge-turns")
    assert exported.exit_code == 0, exported.output
    # the Kimi-style template drops earlier reasoning from history: turns cannot be concatenated, so each stays
    # its own row, counted by reason
    assert "history_changed" in exported.output
    rows = (tmp_path / "sf").glob("*.jsonl")
    assert sum(len(p.read_bytes().splitlines()) for p in rows) == 18


def test_a_turn_whose_reply_cannot_be_parsed_fails_and_resume_goes_on_from_there(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parser endpoints unreachable after a turn: retried, then that turn is a failure (its conversation waits,
    exit 3); resume sends that turn again and goes on; the records equal an uninterrupted run's."""
    from eagle_datagen.errors import ServerError
    from eagle_datagen.generate import turns as turns_module

    rows = [conversation(i, 3) for i in range(8)]
    prompts = write_jsonl(tmp_path / "convs.jsonl", rows)
    whole = tmp_path / "whole"
    assert invoke(*run_args(prompts, whole, tiny_tokenizer, fake_server)).exit_code == 0
    expected = sorted(read_records(whole), key=lambda r: r["id"])

    real = turns_module.parse_reply
    calls = {"n": 0}

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        text = args[2] if len(args) > 2 else kwargs.get("text")
        calls["n"] += 1
        if text != "hello" and calls["n"] % 7 == 0:  # every 7th reply: the parsers are unreachable
            raise ServerError("http://fake/separate_reasoning could not be reached (ConnectError: refused)")
        return await real(*args, **kwargs)

    monkeypatch.setattr(turns_module, "parse_reply", flaky)
    monkeypatch.setattr("eagle_datagen.generate.pipeline.backoff_s", lambda attempt: 0.0)
    out = tmp_path / "out"
    first = invoke(*run_args(prompts, out, tiny_tokenizer, fake_server, "--max-retries", "0"))
    assert first.exit_code == 3, first.output
    failures = [orjson.loads(line) for line in (out / "failures.jsonl").read_bytes().splitlines()]
    assert failures and {f["kind"] for f in failures} == {"parse_failed"}
    assert all(f["id"] == f"{f['conversation']}@t{f['turn']}" for f in failures)
    assert "cut short by a failed turn" in first.output
    on_disk = {r["id"] for r in read_records(out)}
    for failure in failures:  # nothing of a conversation after its failed turn
        assert not any(rid.startswith(f"{failure['conversation']}@t") and int(rid.rsplit("@t", 1)[1]) >= failure["turn"]
                       for rid in on_disk)  # fmt: skip

    monkeypatch.setattr(turns_module, "parse_reply", real)
    second = invoke("resume", "--out", str(out), "--no-progress")
    assert second.exit_code == 0, second.output
    assert sorted(read_records(out), key=lambda r: r["id"]) == expected
    assert invoke("verify-shard", str(out)).exit_code == 0


def test_a_mix_keeps_each_conversation_in_its_variant_and_samples_are_conversations_of_their_own(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 3) for i in range(10)])
    out = tmp_path / "out"
    result = invoke(
        *run_args(prompts, out, tiny_tokenizer, fake_server, "--samples-per-prompt", "2", "--seed", "3",
                  "--mix-entry", 'think:1:{"chat_template_kwargs": {"thinking": true}}',
                  "--mix-entry", 'chat:1:{"chat_template_kwargs": {"thinking": false}}')
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    records = read_records(out)
    assert len(records) == 10 * 2 * 3
    by_conversation: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        assert record["id"] == f"{record['key']}#{record['sample']}@t{record['turn']}"
        by_conversation.setdefault((record["key"], record["sample"]), []).append(record)
    tokenizer = load_tokenizer(tiny_tokenizer)
    think = tokenizer.convert_tokens_to_ids("<think>")
    variants = set()
    for turns in by_conversation.values():
        assert len({r["variant"] for r in turns}) == 1  # one variant for all turns of a conversation
        variants.add(turns[0]["variant"])
        for record in turns:
            thinking = record["variant"] == "think"
            assert (record["prompt_ids"][-1] == think) == thinking
            assert ("reasoning_content" in record["reply"]) == thinking  # none at all with thinking off
        assert len({r["sampling_params"]["sampling_seed"] for r in turns}) == 3  # a seed per turn record
    assert variants == {"think", "chat"}
    assert invoke("verify-shard", str(out)).exit_code == 0


def test_verify_with_a_server_parses_every_reply_again(tmp_path: Path, tiny_tokenizer: Path, fake_server: Any) -> None:
    """verify-shard --server-url: each turn's output_ids parsed again by that server's parsers (the client's own
    parse_turn) must give the recorded reply."""
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 2) for i in range(6)])
    out = tmp_path / "out"
    assert invoke(*run_args(prompts, out, tiny_tokenizer, fake_server)).exit_code == 0
    plain = invoke("verify-shard", str(out), "--json")
    assert any("reply is what the parsers make" in n for n in json.loads(plain.output)["not_checked"])
    checked = invoke("verify-shard", str(out), "--server-url", fake_server.url, "--json")
    assert checked.exit_code == 0, checked.output
    assert not any("reply is what the parsers make" in n for n in json.loads(checked.output)["not_checked"])

    shard = next((out / "shards").glob("shard_*.jsonl"))
    records = [orjson.loads(line) for line in shard.read_bytes().splitlines()]
    for record in records:
        if record["id"] == "c3@t2":  # the last turn: nothing after it repeats its reply
            record["reply"]["reasoning_content"] += " (edited)"
    shard.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    edited = invoke("verify-shard", str(out), "--server-url", fake_server.url, "--json")
    errors = json.loads(edited.output)["errors"]
    assert edited.exit_code == 1
    assert [f["id"] for f in errors["reply_mismatch"]["examples"]] == ["c3@t2"]
    assert set(errors) <= {"reply_mismatch", "shard_checksum"}, errors


def test_show_says_where_a_turn_stands_and_what_its_reply_became(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 2) for i in range(3)])
    out = tmp_path / "out"
    assert invoke(*run_args(prompts, out, tiny_tokenizer, fake_server)).exit_code == 0
    shown = invoke("show", str(out), "--where", "conversation=c1", "--limit", "2", "--no-color")
    assert shown.exit_code == 0, shown.output
    assert "turn 1 of conversation 'c1'; the conversation goes on" in shown.output
    assert "turn 2 of conversation 'c1'; the conversation ends here: complete" in shown.output
    assert "reply (as the parsers split it" in shown.output and "reasoning_content" in shown.output
    assert (
        invoke("show", str(out), "--where", "end=complete", "--limit", "5", "--no-color").output.count("turn 2 of") == 3
    )


def test_render_server_renders_every_turn_through_the_server_and_gives_the_same_records(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle_datagen.server.tokenize import ServerRenderer

    prompts = write_jsonl(tmp_path / "convs.jsonl", [conversation(i, 3) for i in range(5)])
    client = tmp_path / "client"
    assert invoke(*run_args(prompts, client, tiny_tokenizer, fake_server)).exit_code == 0
    rendered: list[int] = []
    real = ServerRenderer.tokenize

    def counting(self: Any, row: Any, path: str = "<prompts>") -> list[int]:
        rendered.append(len(row.messages))
        return real(self, row, path)

    monkeypatch.setattr(ServerRenderer, "tokenize", counting)
    served = tmp_path / "served"
    result = invoke(*run_args(prompts, served, tiny_tokenizer, fake_server, "--render", "server"))
    assert result.exit_code == 0, result.output
    assert {r["id"]: r for r in read_records(served)} == {r["id"]: r for r in read_records(client)}
    assert sum(1 for n in rendered if n >= 3) == 10  # turns 2 and 3 of each conversation: rendered by the server


def test_rows_with_tools_need_a_tool_call_parser_and_none_is_an_answer(
    tmp_path: Path, tiny_tokenizer: Path, fake_server: Any
) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    prompts = write_jsonl(tmp_path / "convs.jsonl", [{**conversation(0, 2), "tools": [tool]}])
    refused = CliRunner().invoke(main, run_args(prompts, tmp_path / "out", tiny_tokenizer, fake_server))
    assert refused.exit_code == 2 and "--tool-call-parser-name none keeps calls as text" in refused.output
    followed = invoke(
        *run_args(prompts, tmp_path / "out", tiny_tokenizer, fake_server, "--tool-call-parser-name", "none")
    )
    assert followed.exit_code == 0, followed.output
    assert len(read_records(tmp_path / "out")) == 2
