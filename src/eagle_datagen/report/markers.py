"""The token ids that split an output into reasoning, answer and tool calls, for ``stats`` and ``show``.

Think ids come from the run's manifest (``facts.think_open_id`` / ``think_close_id``, found by the tokenizer
at run time). Tool-call ids are read from the tokenizer's own files (``tokenizer_config.json``'s
``added_tokens_decoder`` and ``tokenizer.json``'s ``added_tokens``): no tokenizer code runs, so ``stats``
needs neither transformers nor ``--trust-remote-code``. The names are the ones SGLang's parsers treat as
the start of a tool call (docs: shared reasoning-templates, "A tool-call turn can also legitimately lack it").
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Tokens that begin a tool call: Kimi K2/K2.5, Qwen3/GLM, DeepSeek V3/R1, and gpt-oss's end of a call.
TOOL_CALL_TOKENS = (
    "<|tool_calls_section_begin|>",
    "<tool_call>",
    "<｜tool▁calls▁begin｜>",
    "<|call|>",
)
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
#: The prompt opened reasoning when think-open is among its last 2 ids (R1, Qwen3-Thinking add a newline),
#: and turned it off when think-close is among its last 4 (the same rule as verify-shard's prompt shape).
OPEN_TAIL = 2
CLOSED_TAIL = 4


@dataclass(frozen=True)
class Markers:
    """Think and tool-call ids of one run (``None``/empty when the tokenizer has none)."""

    think_open: int | None = None
    think_close: int | None = None
    tool_calls: frozenset[int] = field(default_factory=frozenset)
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    special: Mapping[int, str] = field(default_factory=dict)

    def prompt_opens_reasoning(self, tail: Collection[int] | list[int]) -> bool:
        """Whether a prompt ending in ``tail`` (its last ids) leaves the model inside reasoning."""
        ids = list(tail)
        if self.think_open is None or not ids:
            return False
        last_open = _last(ids[-CLOSED_TAIL:], self.think_open)
        last_close = _last(ids[-CLOSED_TAIL:], self.think_close) if self.think_close is not None else -1
        if last_close > last_open:
            return False
        return last_open >= len(ids[-CLOSED_TAIL:]) - OPEN_TAIL


def _last(ids: list[int], token: int | None) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def added_tokens(tokenizer_dir: Path) -> dict[str, int]:
    """``content → id`` of the tokenizer's added tokens, from its JSON files (nothing is executed)."""
    found: dict[str, int] = {}
    tokenizer_json = _read_json(tokenizer_dir / "tokenizer.json")
    for entry in tokenizer_json.get("added_tokens", []) if isinstance(tokenizer_json, dict) else []:
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and type(entry.get("id")) is int:
            found[entry["content"]] = entry["id"]
    config = _read_json(tokenizer_dir / "tokenizer_config.json")
    decoder = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else {}
    for key, entry in decoder.items() if isinstance(decoder, dict) else []:
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(key).isdigit():
            found.setdefault(entry["content"], int(key))
    return found


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def run_markers(plan: Mapping[str, Any], facts: Mapping[str, Any], tokenizer_dir: Path | None = None) -> Markers:
    """The markers of a run: think ids from the manifest's facts, tool-call ids from the tokenizer's files
    (``tokenizer_dir``, else the path the manifest pinned, when it is still there)."""
    if tokenizer_dir is None:
        pinned = (plan.get("tokenizer") or {}).get("path")
        tokenizer_dir = Path(pinned) if isinstance(pinned, str) else None
    tokens = added_tokens(tokenizer_dir) if tokenizer_dir is not None and tokenizer_dir.is_dir() else {}
    think_open = _int(facts.get("think_open_id"))
    think_close = _int(facts.get("think_close_id"))
    if think_open is None and think_close is None:
        think_open, think_close = tokens.get(THINK_OPEN), tokens.get(THINK_CLOSE)
    stops = {i for i in (facts.get("stop_token_ids") or []) if _int(i) is not None}
    stops |= {i for i in (facts.get("eos_token_ids") or []) if _int(i) is not None}
    return Markers(
        think_open=think_open,
        think_close=think_close,
        tool_calls=frozenset(tokens[name] for name in TOOL_CALL_TOKENS if name in tokens),
        stop_ids=frozenset(stops),
        special={i: name for name, i in tokens.items()},
    )


def _int(value: Any) -> int | None:
    return value if type(value) is int else None
