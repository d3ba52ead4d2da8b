"""Model families on the real tokenizers (../shared/real-tokenizers): detection by rendering, fake-server runs that
verify-shard accepts, and per family a set of wrong outputs rejected with the right kind, by the client and by
verify alike (one shared check)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import RequestFailed
from eagle_datagen.generate.client import parse_generate_response
from eagle_datagen.inputs.render import load_tokenizer, tokenizer_facts
from eagle_datagen.record.checks import RecordSpec, check_record
from eagle_datagen.record.family import Family, PresetMismatch, apply_preset_tokens, detect_family, expectation
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config
from eagle_datagen.verify.verify import format_report, verify

REAL = Path(os.environ.get("EAGLE_REAL_TOKENIZERS", Path(__file__).resolve().parents[2] / "shared" / "real-tokenizers"))
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = pytest.mark.skipif(not REAL.is_dir(), reason=f"no real tokenizers at {REAL} (set EAGLE_REAL_TOKENIZERS)")

#: Measured with transformers 5.24.0 (docs/reasoning-templates.md): reasoning, think ids, generation prompt's
#: last ids, stop ids, tool-call ids, the preset that states these facts.
EXPECTED: dict[str, tuple[str, int | None, int | None, list[int], list[int], list[int], str]] = {
    "qwen3-thinking-2507": ("prompt", 151667, 151668, [151667, 198], [151643, 151645], [151657], "qwen3-thinking-2507"),
    "qwen3-hybrid": ("model", 151667, 151668, [151644, 77091, 198], [151643, 151645], [151657], "qwen3"),
    "deepseek-r1-distill-qwen": (
        "prompt",
        151648,
        151649,
        [151645, 151648, 198],
        [151643],
        [],
        "deepseek-r1-distill-qwen",
    ),
    "gpt-oss": ("harmony", None, None, [200006, 173781], [199999, 200002, 200012], [], "gpt-oss"),
    "kimi-k2.5-synthvocab": ("prompt", 163606, 163607, [163601, 163606], [163585, 163586], [163595], "kimi-k2.5"),
    "kimi-k2.5-synthvocab-fast": ("prompt", 163606, 163607, [163601, 163606], [163585, 163586], [163595], "kimi-k2.5"),
}
DIRS = sorted(p.name for p in REAL.iterdir() if p.is_dir()) if REAL.is_dir() else []
REMOTE = {"kimi-k2.5-synthvocab"}
_TOKENIZERS: dict[str, Any] = {}


def tokenizer_of(name: str) -> Any:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(REAL / name, trust_remote_code=name in REMOTE)
    return _TOKENIZERS[name]


def family_of(name: str, kwargs: dict[str, Any] | None = None) -> Family:
    tokenizer = tokenizer_of(name)
    return detect_family(tokenizer, kwargs, stop_ids=tokenizer_facts(tokenizer, REAL / name).eos_token_ids)


def test_every_real_tokenizer_directory_has_expected_facts() -> None:
    assert DIRS and set(DIRS) == set(EXPECTED)


@pytest.mark.parametrize("name", DIRS)
def test_the_family_is_detected_by_rendering(name: str) -> None:
    reasoning, think_open, think_close, tail, stops, tools, _ = EXPECTED[name]
    family = family_of(name)
    assert family.reasoning == reasoning
    assert (family.think_open, family.think_close) == (think_open, think_close)
    assert list(family.generation_prompt[-len(tail) :]) == tail
    assert sorted(family.stop_ids) == stops
    assert sorted(family.tool_call_ids) == tools
    if name == "gpt-oss":
        assert family.harmony is not None and family.harmony.role == (173781,)
        assert family.harmony.channels["analysis"] == (35644,) and family.harmony.channels["final"] == (17196,)


@pytest.mark.parametrize(
    ("name", "kwargs", "reasoning", "tail"),
    [
        ("qwen3-hybrid", {"enable_thinking": False}, "off", [151667, 271, 151668, 271]),
        ("kimi-k2.5-synthvocab-fast", {"thinking": False}, "off", [163606, 163607]),
        ("qwen3-thinking-2507", {"enable_thinking": False}, "prompt", [151667, 198]),  # no switch: ignored
    ],
)
def test_the_thinking_switch_is_seen_in_the_render(
    name: str, kwargs: dict[str, Any], reasoning: str, tail: list[int]
) -> None:
    family = family_of(name, kwargs)
    assert family.reasoning == reasoning and list(family.generation_prompt[-len(tail) :]) == tail


@pytest.mark.parametrize("name", DIRS)
def test_the_preset_states_what_the_tokenizer_renders(name: str) -> None:
    from eagle_datagen.options import load_preset

    preset = load_preset(CONFIGS / f"{EXPECTED[name][-1]}.toml")
    family = apply_preset_tokens(family_of(name), preset["preset_tokens"], tokenizer_of(name), preset["preset_name"])
    assert family.stop_ids >= frozenset(EXPECTED[name][4])


def test_a_preset_fact_that_disagrees_names_both_values() -> None:
    family = family_of("qwen3-hybrid")
    with pytest.raises(PresetMismatch, match=r"reasoning = 'prompt', but the tokenizer gives 'model'"):
        apply_preset_tokens(family, {"reasoning": "prompt"}, tokenizer_of("qwen3-hybrid"), "x")
    with pytest.raises(
        PresetMismatch, match=r"stop_token_ids = \[151645\], but the tokenizer gives \[151643, 151645\]"
    ):
        apply_preset_tokens(family, {"stop_token_ids": [151645]}, tokenizer_of("qwen3-hybrid"), "x")
    with pytest.raises(PresetMismatch, match=r"unknown key\(s\) think"):
        apply_preset_tokens(family, {"think": 1}, tokenizer_of("qwen3-hybrid"), "x")


# --- fake-server runs that verify-shard accepts ------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip


def rows(name: str) -> list[dict[str, Any]]:
    arguments: Any = '{"city": "Paris"}' if name.startswith("deepseek") else {"city": "Paris"}
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    found = [
        {"id": f"p{i}", "prompt": f"What is {i} + {i}?"} for i in range(6)
    ] + [
        {"id": "sys", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]},
        {"id": "multi", "messages": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "B."},
                                     {"role": "user", "content": "C?"}]},
        {"id": "tool-result", "messages": [{"role": "user", "content": "Weather in Paris?"},
                                           {"role": "assistant", "content": "", "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]},
    ]  # fmt: skip
    if not name.startswith("deepseek"):
        found.append({"id": "tools", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS})
    return found


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [(name, None) for name in DIRS] + [("qwen3-hybrid", {"enable_thinking": False})],
)
def test_a_fake_server_run_on_each_family_verifies(tmp_path: Path, name: str, kwargs: dict[str, Any] | None) -> None:
    tokenizer = tokenizer_of(name)
    facts = tokenizer_facts(tokenizer, REAL / name)
    family = family_config(tokenizer, kwargs)
    eos = tokenizer.eos_token_id
    config = FakeConfig(vocab_size=facts.vocab_size, eos_id=eos, output_len_min=6, output_len_max=40, family=family)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows(name))
    out = tmp_path / "out"
    with FakeSGLangServer(config) as server:
        args = ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(REAL / name),
                "--server-url", server.url, "--no-progress", "--max-new-tokens", "32"]  # fmt: skip
        if name in REMOTE:
            args.append("--trust-remote-code")
        if kwargs:
            args += ["--chat-template-kwargs", orjson.dumps(kwargs).decode()]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "failures: 0" in result.output, result.output
    report = verify([out], trust_remote_code=name in REMOTE)
    assert report.ok and report.records == len(rows(name)), format_report(report)
    assert not report.warnings, format_report(report)
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["facts"]["family"]["reasoning"] == family["reasoning"]
    records = read_records(out)
    shapes = {r["id"]: expectation(Family.from_json(family), r["prompt_ids"]) for r in records}
    if name.startswith("deepseek"):  # after a tool result the template adds no generation prompt: not an error
        assert shapes["tool-result"] == "free" and shapes["p0"] == "inside"


# --- wrong outputs, rejected with the right kind by the client and by verify --------------------------------------

Mutation = Callable[[Family, list[int]], tuple[list[int], dict[str, Any]]]


def good_output(family: Family, prompt: list[int], vocab: int, n: int = 6) -> list[int]:
    """What the fake writes for this prompt (family mode)."""
    from eagle_datagen.testing.fake_sglang import _family_ids, parse_sampling

    config = FakeConfig(vocab_size=vocab, fixed_output_len=n, family=family.to_json())
    return _family_ids(config, prompt, b"\0" * 16, parse_sampling({}))[0]


def stop(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
    return ids, {"type": "stop", "matched": ids[-1]}


def think_twice(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.think_open is not None
    at = out.index(f.think_open) + 1 if f.think_open in out else 0
    return stop([*out[: at + 1], f.think_open, *out[at + 1 :]])


def reopened(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.think_open is not None
    return stop([*out[:-1], f.think_open, 100, out[-1]])


def missing_stop(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    return out[:-1], {"type": "stop", "matched": None}


def stop_inside_reasoning(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    return stop([t for t in out if t != f.think_close])


def unopened(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    return stop([t for t in out if t != f.think_open])


def final_ends_with_end(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.harmony is not None
    return stop([*out[:-1], f.harmony.end, 199999])


def return_after_analysis(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.harmony is not None
    return stop([*out[: out.index(f.harmony.end)], f.harmony.return_])


def no_start_after_end(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.harmony is not None
    return stop([t for t in out if t != f.harmony.start])


def unknown_channel(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.harmony is not None
    return stop([out[0], 24912, *out[2:]])  # "hello" where the channel name belongs


def harmony_stop_in_analysis(f: Family, out: list[int]) -> tuple[list[int], dict[str, Any]]:
    assert f.harmony is not None
    return stop([*out[: out.index(f.harmony.end)], 199999])


THINK_CASES: list[tuple[Mutation, str]] = [
    (think_twice, "think_twice"),
    (reopened, "think_reopened"),
    (missing_stop, "stop_token"),
    (stop_inside_reasoning, "stop_in_reasoning"),
]
CASES: list[tuple[str, Mutation, str]] = [
    *((n, m, k) for n in ("qwen3-thinking-2507", "deepseek-r1-distill-qwen", "kimi-k2.5-synthvocab-fast")
      for m, k in THINK_CASES),
    *(("qwen3-hybrid", m, k) for m, k in [*THINK_CASES, (unopened, "think_unopened")]),
    ("gpt-oss", missing_stop, "stop_token"),
    ("gpt-oss", final_ends_with_end, "channel_structure"),
    ("gpt-oss", return_after_analysis, "channel_structure"),
    ("gpt-oss", no_start_after_end, "channel_structure"),
    ("gpt-oss", unknown_channel, "channel_structure"),
    ("gpt-oss", harmony_stop_in_analysis, "stop_in_reasoning"),
]  # fmt: skip
WARNINGS = {"stop_in_reasoning", "tool_call_ends_reasoning"}


@pytest.mark.parametrize(("name", "mutate", "kind"), CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_wrong_output_is_rejected_with_its_kind_by_client_and_verify(
    tmp_path: Path, name: str, mutate: Mutation, kind: str
) -> None:
    family = family_of(name)
    tokenizer = tokenizer_of(name)
    prompt = [int(i) for i in tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )]  # fmt: skip
    good = good_output(family, prompt, len(tokenizer))
    spec = RecordSpec(len(tokenizer), family.stop_ids, False, family)
    assert check_record(spec, prompt, good, *stop(good)[1:], len(good), max_new_tokens=64).ok
    output, finish = mutate(family, list(good))
    verdict = check_record(spec, prompt, output, finish, len(output), max_new_tokens=64)
    found = verdict.warnings if kind in WARNINGS else verdict.errors
    assert [k for k, _ in found] == [kind], verdict

    body = orjson.dumps(
        {"output_ids": output, "meta_info": {"finish_reason": finish, "completion_tokens": len(output)}}
    )
    if kind in WARNINGS:  # written, with the warning attached
        result = parse_generate_response(body, prompt, {"max_new_tokens": 64}, spec, 0.0)
        assert [k for k, _ in result.warnings] == [kind]
    else:
        with pytest.raises(RequestFailed) as caught:
            parse_generate_response(body, prompt, {"max_new_tokens": 64}, spec, 0.0)
        assert caught.value.kind == f"check_{kind}" and not caught.value.retryable

    # verify-shard on a run directory whose manifest holds the family, as `run` writes it
    manifest = Manifest(tmp_path / MANIFEST_NAME, {"sampling_params": {"max_new_tokens": 64}, "samples_per_prompt": 1})
    manifest.facts = {"vocab_size": len(tokenizer), "stop_token_ids": sorted(family.stop_ids),
                      "family": family.to_json()}  # fmt: skip
    manifest.save()
    (tmp_path / "shards").mkdir()
    record = {"id": "a", "key": "a", "sample": 0, "prompt_ids": prompt, "output_ids": output, "finish_reason": finish,
              "completion_tokens": len(output)}  # fmt: skip
    (tmp_path / "shards" / "shard_00000.jsonl.partial").write_bytes(orjson.dumps(record) + b"\n")
    report = verify([tmp_path], rerender=False)
    assert set(report.warnings if kind in WARNINGS else report.errors) == {kind}, format_report(report)


def test_a_tool_call_that_ends_reasoning_is_a_counted_warning() -> None:
    family = family_of("qwen3-thinking-2507")
    prompt = [1, *family.generation_prompt]
    output = [100, 151657, 101, 151658, 151645]  # reasoning, <tool_call> … </tool_call>, <|im_end|>
    spec = RecordSpec(151669, family.stop_ids, False, family)
    verdict = check_record(spec, prompt, output, {"type": "stop", "matched": 151645}, 5, max_new_tokens=64)
    assert verdict.ok and [k for k, _ in verdict.warnings] == ["tool_call_ends_reasoning"]


def test_a_mix_of_thinking_on_and_off_judges_each_record_by_its_own_prompt() -> None:
    """A run whose kwargs turn thinking off, with a variant that leaves reasoning to the model (Qwen3 hybrid)."""
    off = family_of("qwen3-hybrid", {"enable_thinking": False})
    family = off.with_variants([family_of("qwen3-hybrid")])
    on_prompt = [1, *family_of("qwen3-hybrid").generation_prompt]
    off_prompt = [1, *off.generation_prompt]
    assert (expectation(off, on_prompt), expectation(family, on_prompt)) == ("free", "must_open")
    assert expectation(family, off_prompt) == "off"
    assert Family.from_json(orjson.loads(orjson.dumps(family.to_json()))) == family
