"""The turn plan and the one rule for what follows a generated turn (record/turns.py), shared by the client and
verify-shard."""

from __future__ import annotations

from typing import Any

import pytest

from eagle_datagen.errors import BadInputError
from eagle_datagen.record.turns import (
    END_BAD_TOOL_ARGUMENTS,
    END_COMPLETE,
    END_TOOL_CALL_MISSING,
    END_TOOL_CALLS_DIFFER,
    END_TOOL_RESULTS_MISSING,
    END_TRUNCATED,
    count_calls,
    first_messages,
    next_step,
    plan_turns,
    split_turn_id,
    turn_id,
)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str, *calls: str, ids: bool = True) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {**({"id": f"src_{i}"} if ids else {}), "type": "function",
             "function": {"name": name, "arguments": '{"city": "Paris"}'}}
            for i, name in enumerate(calls)
        ]  # fmt: skip
    return message


def tool(content: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    if name is not None:
        message["name"] = name
    return message


def reply(text: str, *calls: str, arguments: str = '{"city": "Rome"}') -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": "thought"}
    if calls:
        message["tool_calls"] = [
            {"id": f"gen_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, name in enumerate(calls)
        ]
    return message


def test_ids_of_turns_round_trip() -> None:
    assert turn_id("k", 3) == "k@t3" and split_turn_id("k@t3") == ("k", 3)
    assert split_turn_id("k#2@t10") == ("k#2", 10)
    assert split_turn_id("k") is None and split_turn_id("k@t0") is None and split_turn_id("a@b@t2") == ("a@b", 2)


def test_three_user_turns_make_three_turns_and_history_is_the_generated_replies() -> None:
    messages = [{"role": "system", "content": "be brief"}, user("u1"), assistant("a1"), user("u2"), assistant("a2"),
                user("u3")]  # fmt: skip
    plan = plan_turns(messages, "p.jsonl", 4)
    assert plan.turns == 3
    turn1 = first_messages(plan)
    assert turn1 == messages[:2]
    step = next_step(plan, 1, turn1, reply("r1"), "stop")
    assert step.end is None and step.messages == [*messages[:2], reply("r1"), user("u2")]
    assert step.messages is not None
    step2 = next_step(plan, 2, step.messages, reply("r2"), "stop")
    assert step2.messages == [*messages[:2], reply("r1"), user("u2"), reply("r2"), user("u3")]
    assert step2.messages is not None
    assert next_step(plan, 3, step2.messages, reply("r3"), "stop").end == END_COMPLETE
    # the source's own replies never reach a prompt
    assert all(m.get("content") not in ("a1", "a2") for m in step2.messages)


def test_a_truncated_turn_stops_by_default_and_goes_on_when_asked() -> None:
    plan = plan_turns([user("u1"), assistant("a1"), user("u2")], "p", 1)
    assert next_step(plan, 1, first_messages(plan), reply("r1"), "length").end == END_TRUNCATED
    step = next_step(plan, 1, first_messages(plan), reply("r1"), "length", on_truncated="continue")
    assert step.end is None and step.messages is not None and step.messages[-1] == user("u2")


def test_tool_results_are_spliced_with_the_generated_ids_when_the_calls_pair_up() -> None:
    messages = [user("weather?"), assistant("", "get_weather", "get_time"), tool("21C", "src_0"), tool("noon", "src_1"),
                assistant("It is 21C at noon."), user("thanks")]  # fmt: skip
    plan = plan_turns(messages, "p", 1)
    assert plan.turns == 3
    step = next_step(plan, 1, first_messages(plan), reply("", "get_weather", "get_time"), "stop")
    assert step.end is None and step.messages is not None
    assert step.messages[2:] == [
        {"role": "tool", "content": "21C", "tool_call_id": "gen_0"},
        {"role": "tool", "content": "noon", "tool_call_id": "gen_1"},
    ]
    assert count_calls(step.messages) == 2
    # turn 2 answers from the tool results; then the user's thanks
    step2 = next_step(plan, 2, step.messages, reply("21C."), "stop")
    assert step2.messages is not None and step2.messages[-1] == user("thanks")


@pytest.mark.parametrize(
    ("generated", "end"),
    [
        (reply("no call"), END_TOOL_CALL_MISSING),
        (reply("", "get_time", "get_weather"), END_TOOL_CALLS_DIFFER),
        (reply("", "get_weather"), END_TOOL_CALLS_DIFFER),
        (reply("", "get_weather", "get_time", arguments="not json"), END_BAD_TOOL_ARGUMENTS),
        (reply("", "get_weather", "get_time", arguments="[1]"), END_BAD_TOOL_ARGUMENTS),
    ],
)
def test_calls_that_cannot_pair_end_the_conversation_never_inventing_results(generated: Any, end: str) -> None:
    messages = [user("weather?"), assistant("", "get_weather", "get_time"), tool("21C"), tool("noon"), assistant("ok"),
                user("thanks")]  # fmt: skip
    plan = plan_turns(messages, "p", 1)
    step = next_step(plan, 1, first_messages(plan), generated, "stop")
    assert step.messages is None and step.end == end and step.detail


def test_a_call_the_source_has_no_result_for_ends_it() -> None:
    plan = plan_turns([user("u1"), assistant("a1"), user("u2")], "p", 1)
    step = next_step(plan, 1, first_messages(plan), reply("", "get_weather"), "stop")
    assert step.end == END_TOOL_RESULTS_MISSING


def test_results_pair_by_their_name_else_the_source_call_they_answer() -> None:
    # names on the results win; the source call ids are matched next; then their order
    messages = [user("q"), assistant("", "a_fn", "b_fn"), tool("1", name="b_fn"), tool("2", name="a_fn"),
                user("next")]  # fmt: skip
    plan = plan_turns(messages, "p", 1)
    assert next_step(plan, 1, first_messages(plan), reply("", "b_fn", "a_fn"), "stop").end is None
    assert next_step(plan, 1, first_messages(plan), reply("", "a_fn", "b_fn"), "stop").end == END_TOOL_CALLS_DIFFER
    by_id = [user("q"), assistant("", "a_fn", "b_fn"), tool("1", "src_1"), tool("2", "src_0"), user("next")]
    plan = plan_turns(by_id, "p", 1)
    assert next_step(plan, 1, first_messages(plan), reply("", "b_fn", "a_fn"), "stop").end is None


@pytest.mark.parametrize(
    ("messages", "kind"),
    [
        ([assistant("hi"), user("u")], "no_user_turn"),
        ([{"role": "system", "content": "s"}, assistant("hi")], "no_user_turn"),
        ([user("u"), tool("orphan")], "tool_without_call"),
        ([user("u"), assistant("no calls"), tool("orphan")], "tool_without_call"),
        ([user("u"), assistant("", "f"), tool("1"), tool("2")], "tool_without_call"),
        ([user("u"), assistant("a"), assistant("b"), user("v")], "roles_out_of_order"),
        ([user("u"), {"role": "system", "content": "late"}, assistant("a"), user("v")], "roles_out_of_order"),
    ],
)
def test_conversations_no_template_renders_are_bad_rows_naming_the_line(messages: Any, kind: str) -> None:
    with pytest.raises(BadInputError) as info:
        plan_turns(messages, "convs.jsonl", 7)
    assert info.value.kind == kind
    assert "convs.jsonl" in str(info.value) and "7" in str(info.value)
