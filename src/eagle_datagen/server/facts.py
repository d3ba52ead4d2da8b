"""What a server is: its facts (/server_info, /model_info), the checks on them, and health probing.

:class:`FactsCheck` is the one check every server passes, when the run starts and again every time a
server comes back from an outage or a restart: a server that fails it is never used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle_datagen.errors import ServerError
from eagle_datagen.generate.client import get_json, is_healthy
from eagle_datagen.generate.pool import backoff_s
from eagle_datagen.inputs.render import model_vocab_size

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
#: ``--preferred-sampling-params`` keys that are refused: SGLang merges them into every request for the keys
#: the request leaves out (``{**preferred_sampling_params, **obj.sampling_params}``), so they would cut,
#: stretch or constrain the outputs behind the plan's back.
REFUSED_PREFERRED_KEYS = {
    "stop": "cuts outputs at text stop strings",
    "stop_regex": "cuts outputs at text patterns",
    "ignore_eos": "outputs would never end in EOS",
    "min_new_tokens": "forbids the stop token until then",
    "regex": "constrains outputs to a pattern",
    "json_schema": "constrains outputs to a schema",
    "ebnf": "constrains outputs to a grammar",
    "structural_tag": "constrains outputs to a structure",
    "n": "several outputs per request",
}
#: Facts that make "the same model": every server of a run, and each one again after it comes back.
IDENTITY_FIELDS = ("model_path", "weight_version", "vocab_size", "reasoning_parser", "preferred_sampling_params")


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
    #: From the model directory's config.json when ``model_path`` is a directory on this machine.
    vocab_size: int | None = None
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str | None = None
    #: For an sglang-router: the URLs of its workers (the facts above are theirs, read from each).
    workers: tuple[str, ...] = ()
    #: False when /model_info (or /get_model_info) did not answer: the facts from it are unknown, not None.
    complete: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            **({"router_workers": list(self.workers)} if self.workers else {}),
            "url": self.url,
            "version": self.version,
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "vocab_size": self.vocab_size,
            "reasoning_parser": self.reasoning_parser,
            "preferred_sampling_params": self.preferred_sampling_params,
            "max_req_input_len": self.max_req_input_len,
            "max_running_requests": self.max_running_requests,
            "args": self.args,
        }

    def identity(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}


async def read_server_facts(http: httpx.AsyncClient, url: str) -> ServerFacts:
    """Reads /server_info (or /get_server_info) and /model_info (or /get_model_info); for an sglang-router,
    those of each of its workers (:func:`~eagle_datagen.server.router.read_router_facts`)."""
    from eagle_datagen.server.router import read_router_facts, router_worker_urls

    worker_urls = await router_worker_urls(http, url)
    if worker_urls is not None:
        return await read_router_facts(http, url, worker_urls)
    info = await get_json(http, url, "/server_info", "/get_server_info")
    complete = True
    try:
        model = await get_json(http, url, "/model_info", "/get_model_info")
    except ServerError:
        model, complete = {}, False
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    max_running = _total_max_running(info, states)
    max_input = _int(info.get("max_req_input_len")) or _int(state.get("max_req_input_len"))
    parser = info.get("reasoning_parser") or model.get("reasoning_parser")
    model_path = model.get("model_path") or info.get("model_path")
    weight_version = model.get("weight_version")
    return ServerFacts(
        url=url,
        version=str(info["version"]) if info.get("version") is not None else None,
        model_path=model_path,
        reasoning_parser=str(parser) if parser else None,
        max_req_input_len=max_input,
        max_running_requests=max_running,
        args={k: info[k] for k in RECORDED_ARGS if k in info},
        vocab_size=model_vocab_size(model_path) if isinstance(model_path, str) and model_path else None,
        preferred_sampling_params=_preferred(
            model.get("preferred_sampling_params", info.get("preferred_sampling_params"))
        ),
        weight_version=str(weight_version) if weight_version is not None else None,
        complete=complete,
    )


def _preferred(value: Any) -> dict[str, Any] | None:
    """``--preferred-sampling-params`` as SGLang reports it (an object, or the JSON text given on its command line)."""
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except ValueError:
            return {"<unparsable>": value}
    return value if isinstance(value, dict) and value else None


def _total_max_running(info: dict[str, Any], states: Any) -> int | None:
    """What the whole server runs at once: the sum over its data-parallel replicas.

    SGLang reports ``internal_states`` per DP rank, each with the scheduler's effective cap; the
    ``max_running_requests`` server arg is a per-scheduler setting (or ``None``), so it counts once per
    replica. A list shorter than ``dp_size`` is scaled up to it.
    """
    dp_size = _int(info.get("dp_size")) or 1
    per_rank = [
        _int(s.get("effective_max_running_requests_per_dp")) or _int(s.get("max_running_requests"))
        for s in (states if isinstance(states, list) else [])
        if isinstance(s, dict)
    ]
    known = [n for n in per_rank if n is not None]
    if known and len(known) == len(per_rank):
        return sum(known) * dp_size // len(known) if len(known) < dp_size else sum(known)
    per_scheduler = _int(info.get("max_running_requests"))
    return per_scheduler * dp_size if per_scheduler is not None else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_server_facts(facts: ServerFacts, *, allow_reasoning_parser: bool) -> None:
    """Refuses a server that would rewrite outputs (:class:`FactsCheck` runs this and the rest)."""
    FactsCheck(allow_reasoning_parser=allow_reasoning_parser).check(facts)


@dataclass
class FactsCheck:
    """The one facts check, for every server when the run starts and again after every recovery.

    A server is refused when it runs a reasoning parser, when its ``--preferred-sampling-params`` set a
    key of :data:`REFUSED_PREFERRED_KEYS`, when its model's vocab_size differs from the tokenizer's model,
    when it serves another model than the run's first server (:data:`IDENTITY_FIELDS`), and, after a
    recovery, when its ``max_req_input_len`` fell below the limit the prompts were admitted under.
    """

    allow_reasoning_parser: bool = False
    #: vocab_size of the tokenizer's own model (its config.json), when known.
    model_vocab: int | None = None
    #: The run's first server, as it was at the start: every server must match it.
    reference: ServerFacts | None = None
    #: The smallest max_req_input_len at the start: prompts were set aside against it.
    max_input_len: int | None = None

    def start(self, servers: list[ServerFacts]) -> None:
        """Checks every server of a run; the first becomes the reference for all of them, for the whole run."""
        for facts in servers:
            self.check(facts, recovered=False)
        known = [f.max_req_input_len for f in servers if f.max_req_input_len is not None]
        self.max_input_len = min(known) if known else None

    def check(self, facts: ServerFacts, *, recovered: bool = True) -> None:
        """Raises :class:`ServerError` naming every fact that is wrong (the server is then never used)."""
        problems: list[str] = []
        parser_refused = bool(facts.reasoning_parser) and not self.allow_reasoning_parser
        if parser_refused:
            problems.append(
                f"it runs with --reasoning-parser {facts.reasoning_parser}. The parser rewrites outputs for the OpenAI "
                "endpoints and the <think> belongs to the prompt: this pipeline needs raw ids. Restart the server "
                "without it, or pass --allow-reasoning-parser if you know /generate is unaffected"
            )
        refused = sorted(set(facts.preferred_sampling_params or {}) & set(REFUSED_PREFERRED_KEYS))
        if refused:
            why = "; ".join(f"{key}: {REFUSED_PREFERRED_KEYS[key]}" for key in refused)
            problems.append(
                f"its --preferred-sampling-params set {', '.join(refused)} ({why}), and SGLang applies them to every "
                "request that leaves them out; restart it without those keys"
            )
        if self.model_vocab is not None and facts.vocab_size is not None and facts.vocab_size != self.model_vocab:
            problems.append(
                f"its model {facts.model_path!r} has vocab_size {facts.vocab_size}, the tokenizer's model "
                f"{self.model_vocab}: it is another model"
            )
        ref = self.reference
        other_model = False
        if ref is not None:
            for name in IDENTITY_FIELDS:
                want, got = getattr(ref, name), getattr(facts, name)
                if want != got and not (name == "reasoning_parser" and parser_refused):
                    where = "at the start of the run" if recovered else f"on {ref.url}"
                    problems.append(f"{name} is {got!r}, not {want!r} as {where}")
                    other_model = True
        limit = self.max_input_len
        if recovered and limit is not None and facts.max_req_input_len is not None and facts.max_req_input_len < limit:
            problems.append(
                f"max_req_input_len is {facts.max_req_input_len}, below the {limit} the prompts were admitted under"
            )
        if problems:
            if recovered:
                head = f"{facts.url} came back changed, so it is left out of the pool and never used again"
                tail = "Restore it as it was; a later resume uses it again"
                raise ServerError(f"{head}: {'; '.join(problems)}. {tail}")
            tail = (
                ". Every server of a run must serve the same model the same way: give --server-url only for those"
                if other_model
                else ""
            )
            raise ServerError(f"{facts.url} is refused: {'; '.join(problems)}{tail}")
        if self.reference is None:
            self.reference = facts


def resumed_model_warnings(previous: Any, facts: ServerFacts) -> list[str]:
    """On resume: the facts that make "the same model" (:data:`IDENTITY_FIELDS`) that differ from those the
    manifest recorded for the earlier runs' first server (their records and these would mix two models)."""
    if not isinstance(previous, list) or not previous or not isinstance(previous[0], dict):
        return []
    before = previous[0]
    changed = [
        f"{name} {before.get(name)!r} then, {getattr(facts, name)!r} now"
        for name in IDENTITY_FIELDS
        if name in before and before[name] != getattr(facts, name)
    ]
    if not changed:
        return []
    return [
        f"{facts.url} does not serve the model the records already written came from ({'; '.join(changed)}). "
        "If the model only moved, this is fine; otherwise stop and give a new --out, or the dataset mixes two models"
    ]


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
    http: httpx.AsyncClient,
    url: str,
    *,
    give_up_after_s: float,
    path: str = "/health_generate",
    alive: Callable[[], bool] | None = None,
) -> bool:
    """Probes ``url`` with backoff until healthy; False after ``give_up_after_s``, or as soon as ``alive()``
    says the server's process is gone (a launched server: then it is restarted without waiting)."""
    deadline = time.monotonic() + give_up_after_s
    attempt = 0
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        if await is_healthy(http, url, timeout_s=min(30.0, max(1.0, deadline - time.monotonic())), path=path):
            return True
        attempt += 1
        await asyncio.sleep(
            min(backoff_s(attempt, base_s=0.5, cap_s=30.0) + 0.2, max(0.0, deadline - time.monotonic()))
        )
    return False
