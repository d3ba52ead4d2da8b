"""Shared fixtures: tiny tokenizers built offline, fake SGLang servers, prompt files."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest_plugins = ["real_sglang"]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Kimi-K2.5-style tokenizer: the generation prompt ends with <think>."""
    from eagle_datagen.testing.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok-kimi"), template="kimi")


@pytest.fixture(scope="session")
def chatml_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle_datagen.testing.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok-chatml"), template="chatml")


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_tokenizer: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer))


@pytest.fixture
def fake_server(hf_tokenizer: Any, tiny_tokenizer: Path) -> Iterator[Any]:
    """A fake SGLang server whose vocabulary matches the tiny tokenizer (and whose /v1/tokenize renders with it)."""
    from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config

    # family mode: outputs shaped as the tiny Kimi-style family writes them (so the record checks accept them)
    config = FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        max_running_requests=32,
        tokenizer_path=str(tiny_tokenizer),
        family=family_config(hf_tokenizer),
    )
    server = FakeSGLangServer(config).start()
    try:
        yield server
    finally:
        server.stop()


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def varied_rows(n: int) -> list[dict[str, Any]]:
    """Rows of every accepted shape, with explicit and hashed keys."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            rows.append({"id": f"p{i}", "prompt": f"question number {i}: what is {i} plus {i}?"})
        elif kind == 1:
            rows.append(
                {
                    "id": i,
                    "messages": [
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": f"tell me about {i}"},
                        {"role": "assistant", "content": "old reply to drop"},
                    ],
                }
            )
        elif kind == 2:
            rows.append(
                {
                    "conversations": [
                        {"from": "human", "value": f"first turn {i}"},
                        {"from": "gpt", "value": f"answer {i}"},
                        {"from": "human", "value": f"second turn {i}"},
                    ]
                }
            )
        else:
            rows.append(
                {
                    "id": f"t{i}",
                    "messages": [{"role": "user", "content": [{"type": "text", "text": f"parts {i}"}]}],
                    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
                }
            )
    return rows


#: Record fields that say when and where a record was made, not what it is (two runs differ in them).
RUN_STAMPS = ("started", "finished", "server")


def served_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as SGLang's chat path hands them to the template (pydantic ``Tool.model_dump()``: the function's
    keys as sent, then ``description``/``parameters`` as null when absent; ``defer_loading: null`` on the tool)."""
    if not tools:
        return tools
    served = []
    for tool in tools:
        function = {k: v for k, v in tool["function"].items() if k in ("description", "name", "parameters")}
        function.update({k: None for k in ("description", "name", "parameters") if k not in function})
        served.append({"type": tool.get("type", "function"), "function": function, "defer_loading": None})
    return served


def read_records(out_dir: Path, *, stamps: bool = False) -> list[dict[str, Any]]:
    """Every record under ``out_dir/shards``; without the :data:`RUN_STAMPS` unless ``stamps``."""
    records = []
    for path in sorted((out_dir / "shards").glob("shard_*.jsonl*")):
        records += [orjson.loads(line) for line in path.read_bytes().splitlines()]
    if not stamps:
        for record in records:
            for name in RUN_STAMPS:
                record.pop(name, None)
    return records


def python_with_env(path: Path, python: str | Path, **env: str) -> str:
    """An executable at ``path`` that runs ``python`` with ``env`` exported, as a node's environment would
    provide it to a server (or router) that eagle-datagen launches with ``--server-python``."""
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())
    path.write_text(f'#!/bin/sh\n{exports}exec {shlex.quote(str(python))} "$@"\n')
    path.chmod(0o755)
    return str(path)
