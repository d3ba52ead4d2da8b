"""Model presets (configs/*.toml): they parse, hold the facts verification needs, and flags override them."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from conftest import read_records, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.options import PRESET_SECTIONS, build_run_config, load_preset, merge, savable
from eagle_datagen.server.launcher import check_server_args, launch_command

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STANDIN = Path(__file__).resolve().parent / "standin"

#: docs/reasoning-templates.md: the family's reasoning, <think>, </think>, whether the prompt ends inside the
#: reasoning, the stop ids, and the thinking switch of the template.
FACTS: dict[str, tuple[str, int | None, int | None, bool | None, list[int], dict[str, Any]]] = {
    "kimi-k2.5": ("prompt", 163606, 163607, True, [163586, 163585], {"thinking": True}),
    "kimi-k2-thinking": ("model", 163606, 163607, False, [163586, 163585], {}),
    "qwen3": ("model", 151667, 151668, False, [151645, 151643], {"enable_thinking": True}),
    "qwen3-thinking-2507": ("prompt", 151667, 151668, True, [151645, 151643], {}),
    "qwen3-instruct-2507": ("none", None, None, None, [151645, 151643], {}),
    "deepseek-r1": ("prompt", 128798, 128799, True, [1], {}),
    "deepseek-r1-distill-qwen": ("prompt", 151648, 151649, True, [151643], {}),
    "deepseek-v3.1": ("prompt", 128798, 128799, True, [1], {"thinking": True}),
    "glm-4.5": ("model", 151350, 151351, False, [151329, 151336, 151338], {"enable_thinking": True}),
    "gpt-oss": ("harmony", None, None, None, [200002, 199999, 200012], {"reasoning_effort": "medium"}),
    "minimax-m2": ("prompt", 200050, 200051, True, [200020], {}),
}


def test_every_family_has_a_preset() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*.toml")) == sorted(FACTS)


def base_options(tmp_path: Path) -> dict[str, Any]:
    return {"prompts": tmp_path / "p.jsonl", "out": tmp_path / "out", "model": tmp_path / "model"}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_a_preset_parses_and_builds_a_launch(name: str, tmp_path: Path) -> None:
    preset = load_preset(CONFIGS / f"{name}.toml")
    reasoning, think_open, think_close, in_prompt, stop_ids, kwargs = FACTS[name]
    assert preset["preset_name"] == name
    tokens = preset["preset_tokens"]
    assert tokens["reasoning"] == reasoning
    assert (tokens.get("think_open"), tokens.get("think_close"), tokens.get("think_open_in_prompt")) == (
        think_open,
        think_close,
        in_prompt,
    )
    assert tokens["stop_token_ids"] == stop_ids and isinstance(tokens["prompt_tail"], str)
    assert preset.get("chat_template_kwargs", {}) == kwargs

    config = build_run_config(merge(preset, base_options(tmp_path)))
    launch = config.server.launch
    assert launch is not None and launch.tp_size in (1, 8) and launch.mem_fraction_static == 0.85
    check_server_args(launch.server_args, allow_reasoning_parser=False)
    assert "--reasoning-parser" not in " ".join(launch_command(launch, 30000, None))
    assert config.chat_template_kwargs == kwargs
    assert config.preset == name
    assert config.sampling.max_new_tokens == preset["max_new_tokens"] >= 4096
    assert {k: config.sampling.params[k] for k in ("temperature", "top_p")} == {
        "temperature": preset["temperature"],
        "top_p": preset["top_p"],
    }


def test_presets_use_only_known_options() -> None:
    known = set().union(*PRESET_SECTIONS.values()) | {
        "chat_template_kwargs",
        "preset_tokens",
        "preset_name",
        "preset_sampling",
    }
    known |= {f"{key}_name" for key in PRESET_SECTIONS["parsers"]}  # [parsers] give --*-parser-name
    for path in CONFIGS.glob("*.toml"):
        assert set(load_preset(path)) <= known, path


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_preset_names_sglang_parsers_and_they_reach_turns_all(path: Path, tmp_path: Path) -> None:
    """--turns all splits each reply with SGLang's own parsers: each preset names them (SGLang 0.5.23's choices,
    the fake's table is checked against the real ones), and a flag overrides the preset."""
    from eagle_datagen.testing.fake_parsers import SGLANG_REASONING_PARSERS, SGLANG_TOOL_CALL_PARSERS

    preset = load_preset(path)
    reasoning, tools = preset["reasoning_parser_name"], preset["tool_call_parser_name"]
    assert reasoning == "none" or reasoning in SGLANG_REASONING_PARSERS, reasoning
    assert tools == "none" or tools in SGLANG_TOOL_CALL_PARSERS, tools
    config = build_run_config(merge(preset, {"turns": "all"}, base_options(tmp_path)))
    assert config.turns is not None
    assert config.turns.reasoning_parser == (None if reasoning == "none" else reasoning)
    assert config.turns.tool_call_parser == (None if tools == "none" else tools)
    flagged = build_run_config(merge(preset, {"turns": "all", "tool_call_parser_name": "none"}, base_options(tmp_path)))
    assert flagged.turns is not None and flagged.turns.tool_call_parser is None
    assert build_run_config(merge(preset, base_options(tmp_path))).turns is None  # --turns last: none of it


def test_explicit_flags_override_the_preset(tmp_path: Path) -> None:
    preset = load_preset(CONFIGS / "kimi-k2.5.toml")
    flags = {
        "tp_size": 1,
        "mem_fraction_static": 0.5,
        "temperature": 0.0,
        "max_new_tokens": 64,
        "server_arg": ["--device=cpu"],
        "chat_template_kwargs": '{"thinking": false}',
        "startup_timeout_s": 60.0,
        "top_p": None,  # a flag not given does not erase the preset's value
    }
    config = build_run_config(merge(preset, flags, base_options(tmp_path)))
    launch = config.server.launch
    assert launch is not None
    assert (launch.tp_size, launch.mem_fraction_static, launch.startup_timeout_s) == (1, 0.5, 60.0)
    assert launch.server_args == ("--device=cpu",) and launch.trust_remote_code
    assert config.sampling.to_request() == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 0.95}
    assert config.chat_template_kwargs == {"thinking": False}


def test_a_preset_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    from eagle_datagen.errors import UsageError

    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[server]\ntp = 8\n')
    with pytest.raises(UsageError, match=r"\[server\] tp is not a preset option"):
        load_preset(bad)


@pytest.fixture(scope="module")
def kimi_ids_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Kimi-style tokenizer with Kimi-K2.5's real special ids (what configs/kimi-k2.5.toml states)."""
    from eagle_datagen.testing.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok-kimi-ids"), template="kimi", kimi_ids=True)


def standin_pythonpath() -> str:
    """The stand-in server imports this checkout's package, not whatever the venv has installed."""
    return os.pathsep.join([str(STANDIN), str(STANDIN.parents[1] / "src")])


def preset_run_args(model: Path, prompts: Path, out: Path) -> list[str]:
    return [
        "run", "--config", str(CONFIGS / "kimi-k2.5.toml"), "--prompts", str(prompts), "--out", str(out),
        "--model", str(model), "--server-python", sys.executable, "--tp-size", "1", "--temperature", "0",
        "--max-new-tokens", "16", "--server-arg=--device=cpu", "--no-progress",
    ]  # fmt: skip


def test_run_with_a_preset_and_overriding_flags(
    tmp_path: Path, kimi_ids_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config configs/kimi-k2.5.toml` on the command line, with a launched (stand-in) server."""
    from eagle_datagen.inputs.render import load_tokenizer
    from eagle_datagen.testing.fake_sglang import family_config

    tokenizer = load_tokenizer(kimi_ids_tokenizer)
    fake = {"vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id, "max_running_requests": 8,
            "family": family_config(tokenizer)}  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", standin_pythonpath())
    monkeypatch.setenv("FAKE_SGLANG_CONFIG_JSON", orjson.dumps(fake).decode())
    model = Path(shutil.copytree(kimi_ids_tokenizer, tmp_path / "model"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"k{i}", "prompt": f"q {i}"} for i in range(5)])
    out = tmp_path / "out"
    result = CliRunner().invoke(main, preset_run_args(model, prompts, out), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    command = manifest["server"]["launch_command"]
    assert command[command.index("--tp-size") + 1] == "1"
    assert "--trust-remote-code" in command and command[-1] == "--device=cpu"
    assert manifest["plan"]["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 0.95}
    assert manifest["plan"]["chat_template_kwargs"] == {"thinking": True}
    assert manifest["facts"]["preset"] == "kimi-k2.5"
    assert manifest["facts"]["sampling_origins"] == {
        "max_new_tokens": "flag",
        "temperature": "flag",
        "top_p": "preset kimi-k2.5",
    }
    # the preset's stop ids joined the stop set (the tiny tokenizer itself only names <|im_end|>)
    assert {163585, 163586} <= set(manifest["facts"]["stop_token_ids"])
    assert manifest["facts"]["family"]["reasoning"] == "prompt"
    assert sorted(r["id"] for r in read_records(out)) == [f"k{i}" for i in range(5)]


def test_a_preset_for_another_model_stops_the_run_naming_both_values(
    tmp_path: Path, tiny_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny tokenizer's <think> is 514, the Kimi preset says 163606: nothing is launched, both are named."""
    model = Path(shutil.copytree(tiny_tokenizer, tmp_path / "model"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "k", "prompt": "q"}])
    monkeypatch.setenv("PYTHONPATH", standin_pythonpath())
    result = CliRunner().invoke(main, preset_run_args(model, prompts, tmp_path / "out"))
    assert result.exit_code == 2
    assert "[tokens] says think_open = 163606, but the tokenizer gives 514" in result.output
    assert not (tmp_path / "out" / "server.log").exists()


@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ("[samplng]\ntemperature = 1.0\n", ["[samplng] is not a preset section", "[sampling]"]),
        ("[chat_template_kwarg]\nthinking = false\n", ["[chat_template_kwarg]", "[chat_template_kwargs]"]),
        ("[servr]\ntp_size = 1\n", ["[servr]", "[server]"]),
        ("temperature = 1.0\n", ["top-level key 'temperature'", "known top-level keys: name"]),
        ("sampling = 1\n", ["top-level key 'sampling'", "(a [sampling] section?)"]),
        ("[tokens]\nthink_opn = 3\n", ["[tokens] think_opn is not a preset option", "think_open"]),
        ("name = 3\n", ["name must be a string"]),
    ],
)
def test_unknown_preset_sections_and_keys_are_refused_by_name(tmp_path: Path, toml: str, names: list[str]) -> None:
    """D19: a misspelt section used to vanish without a word (the run went greedy, thinking on)."""
    from eagle_datagen.errors import UsageError

    bad = tmp_path / "typo.toml"
    bad.write_text(f'name = "typo"\n{toml}' if not toml.startswith("name") else toml)
    with pytest.raises(UsageError) as caught:
        load_preset(bad)
    message = str(caught.value)
    assert message.startswith(f"{bad}: ")
    for name in names:
        assert name in message


def test_sampling_provenance_names_the_preset_not_flags(tmp_path: Path) -> None:
    """D19: values from a preset were recorded as "greedy + flags" although no flag was given."""
    preset = load_preset(CONFIGS / "qwen3.toml")
    config = build_run_config(merge(preset, base_options(tmp_path)))
    assert config.sampling.origins == dict.fromkeys(
        ("max_new_tokens", "temperature", "top_p", "top_k", "min_p"), "preset qwen3"
    )
    assert config.sampling.source == "preset qwen3"
    # a flag equal to nothing in the preset is a flag; the rest stays the preset's, through a resume too
    flags = merge(preset, {"top_k": 5, "sampling_params": '{"repetition_penalty": 1.1}'}, base_options(tmp_path))
    config = build_run_config(flags)
    assert config.sampling.origins["top_k"] == "flag" and config.sampling.origins["repetition_penalty"] == "flag"
    assert config.sampling.origins["top_p"] == "preset qwen3"
    resumed = build_run_config(merge(savable(flags), base_options(tmp_path)))
    assert resumed.sampling.origins == config.sampling.origins
    assert resumed.sampling.source == "preset qwen3 + flags"
    plain = build_run_config(base_options(tmp_path))
    assert plain.sampling.origins == {"max_new_tokens": "eagle-datagen default", "temperature": "eagle-datagen default"}
    assert plain.sampling.source == "greedy"
