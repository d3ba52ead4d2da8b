"""What a server is: its facts (/server_info, /model_info), the checks on them, and health probing."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle_datagen.errors import ServerError
from eagle_datagen.generate.client import get_json, is_healthy
from eagle_datagen.generate.pool import backoff_s

log = logging.getLogger(__name__)

#: Server args worth keeping in the manifest (the rest of /server_info is noise for a reader).
RECORDED_ARGS = (
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "tp_size",
    "dp_size",
    "context_length",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_running_requests",
    "max_total_tokens",
    "chunked_prefill_size",
    "mem_fraction_static",
    "reasoning_parser",
    "tool_call_parser",
    "skip_tokenizer_init",
    "random_seed",
    "enable_deterministic_inference",
    "attention_backend",
    "sampling_backend",
    "speculative_algorithm",
    "preferred_sampling_params",
    "sampling_defaults",
    "device",
)
#: Used when a server does not say how many requests it runs at once.
FALLBACK_MAX_RUNNING = 64


@dataclass(frozen=True)
class ServerFacts:
    """What one server told us about itself."""

    url: str
    version: str | None
    model_path: str | None
    reasoning_parser: str | None
    max_req_input_len: int | None
    max_running_requests: int | None
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "model_path": self.model_path,
            "reasoning_parser": self.reasoning_parser,
            "max_req_input_len": self.max_req_input_len,
            "max_running_requests": self.max_running_requests,
            "args": self.args,
        }


async def read_server_facts(http: httpx.AsyncClient, url: str) -> ServerFacts:
    """Reads /server_info (or /get_server_info) and /model_info (or /get_model_info)."""
    info = await get_json(http, url, "/server_info", "/get_server_info")
    try:
        model = await get_json(http, url, "/model_info", "/get_model_info")
    except ServerError:
        model = {}
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    max_running = _int(info.get("max_running_requests"))
    if max_running is None:
        per_dp = _int(state.get("effective_max_running_requests_per_dp")) or _int(state.get("max_running_requests"))
        if per_dp is not None:
            max_running = per_dp * (_int(info.get("dp_size")) or 1)
    max_input = _int(info.get("max_req_input_len")) or _int(state.get("max_req_input_len"))
    parser = info.get("reasoning_parser") or model.get("reasoning_parser")
    return ServerFacts(
        url=url,
        version=str(info["version"]) if info.get("version") is not None else None,
        model_path=model.get("model_path") or info.get("model_path"),
        reasoning_parser=str(parser) if parser else None,
        max_req_input_len=max_input,
        max_running_requests=max_running,
        args={k: info[k] for k in RECORDED_ARGS if k in info},
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_server_facts(facts: ServerFacts, *, allow_reasoning_parser: bool) -> None:
    """Refuses a server that would rewrite outputs."""
    if facts.reasoning_parser and not allow_reasoning_parser:
        raise ServerError(
            f"{facts.url} runs with --reasoning-parser {facts.reasoning_parser}. The parser rewrites outputs for the "
            "OpenAI endpoints and the <think> belongs to the prompt: this pipeline needs raw ids. Restart the server "
            "without it, or pass --allow-reasoning-parser if you know /generate is unaffected"
        )


def model_mismatch_warnings(
    facts: ServerFacts, tokenizer_path: Path, tokenizer_vocab: int, model_vocab: int | None
) -> list[str]:
    """Warnings when the served model looks different from the local tokenizer."""
    warnings: list[str] = []
    if facts.model_path and Path(facts.model_path).name != tokenizer_path.resolve().name:
        warnings.append(
            f"{facts.url} serves {facts.model_path!r} but prompts are rendered with the tokenizer at {tokenizer_path}; "
            "make sure they are the same model"
        )
    if model_vocab is not None and tokenizer_vocab > model_vocab:
        warnings.append(
            f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {model_vocab}; prompts with ids "
            "outside the model's vocabulary are set aside (SGLang crashes on them)"
        )
    return warnings


def default_concurrency(endpoints_max_running: list[int | None]) -> int:
    """Requests in flight: what the servers run at once, plus headroom so their queues never run dry."""
    total = sum(m or FALLBACK_MAX_RUNNING for m in endpoints_max_running)
    return total + max(8, total // 4)


async def wait_until_healthy(
    http: httpx.AsyncClient, url: str, *, give_up_after_s: float, path: str = "/health_generate"
) -> bool:
    """Probes ``url`` with backoff until healthy; False after ``give_up_after_s``."""
    deadline = time.monotonic() + give_up_after_s
    attempt = 0
    while time.monotonic() < deadline:
        if await is_healthy(http, url, path=path):
            return True
        attempt += 1
        await asyncio.sleep(
            min(backoff_s(attempt, base_s=0.5, cap_s=30.0) + 0.2, max(0.0, deadline - time.monotonic()))
        )
    return False
