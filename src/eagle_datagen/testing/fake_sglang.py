"""A fake SGLang 0.5.x HTTP server for tests and benchmarks.

It follows docs/sglang-contract.md: native ``/generate`` with token-id prompts, strict ``sampling_params``,
SGLang's error shapes, the stop token kept in ``output_ids``, and the health/info endpoints. Outputs are a
pure function of (input_ids, sampling_params), see :func:`expected_output`.

The HTTP/1.1 server is a minimal ``asyncio.Protocol`` (keep-alive, Content-Length bodies) so that one core can
serve thousands of responses per second. Run it in-process (:class:`FakeSGLangServer`) or as a subprocess::

    python -m eagle_datagen.testing.fake_sglang --port 0 --port-file PATH [--config-json JSON] [--FIELD V]

SGLang's native parser endpoints ``POST /separate_reasoning`` and ``POST /parse_function_call`` work on text with
the parsers of :mod:`eagle_datagen.testing.fake_parsers` (request, answer and error shapes as SGLang 0.5.23's).

Extra endpoints: ``GET /fake/stats``, ``GET|POST /fake/config``, ``POST /fake/restart``,
``POST /fake/reset_stats``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import hmac
import os
import random
import signal
import sys
import threading
import time
import typing
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from eagle_datagen.config import SGLANG_INT_KEYS, SGLANG_SAMPLING_FIELDS
from eagle_datagen.testing import fake_parsers

SAMPLING_KEYS = SGLANG_SAMPLING_FIELDS  # docs/sglang-contract.md §1.1
_SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)
_INT_KEYS = SGLANG_INT_KEYS
_FLOAT_KEYS = frozenset(
    {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
)
_BOOL_KEYS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})
DEFAULT_MAX_NEW_TOKENS = 128
MIN_TOKEN_ID = 3  # non-EOS output ids are drawn from [MIN_TOKEN_ID, vocab_size)
LEAK_TAIL = 5
_TIMELINE_MAX = 200_000
ERROR_503: dict[str, Any] = {
    "object": "error",
    "message": "The request queue is full.",
    "type": "503",
    "param": None,
    "code": 503,
}
UNAUTHORIZED: dict[str, Any] = {"error": "Unauthorized"}
ERROR_429: dict[str, Any] = {
    "object": "error",
    "message": "Too many requests",
    "type": "429",
    "param": None,
    "code": 429,
}


@dataclass
class FakeConfig:
    """Behaviour of the fake server. Rates are probabilities per request (or per batch item)."""

    vocab_size: int = 1000
    eos_id: int = 2
    output_len_min: int = 8
    output_len_max: int = 64
    fixed_output_len: int | None = None
    max_req_input_len: int = 4096
    context_length: int = 8192
    max_running_requests: int = 128
    max_total_num_tokens: int = 131072
    tp_size: int = 1
    dp_size: int = 1
    capacity: int | None = None  # at most this many /generate items served at once, the rest wait FIFO
    time_per_token_s: float = 0.0  # service time per output token, while holding a slot
    latency_s: float = 0.0  # fixed service time per item, while holding a slot
    error_503_rate: float = 0.0
    error_429_rate: float = 0.0  # a router's "too many requests"
    retry_after_s: int | None = None  # Retry-After (seconds) on every 503 and 429 answer
    # SGLang's --max-queued-requests: with ``capacity`` busy and this many waiting, /generate answers 503
    # "The request queue is full." (what a healthy but overloaded server does)
    max_queued_requests: int | None = None
    drop_rate: float = 0.0  # close the connection without a response
    stall_after: int | None = None  # after this many /generate requests, stop answering for stall_s
    stall_s: float = 0.0
    crash_after: int | None = None  # after this many /generate responses the server crashes
    startup_delay_s: float = 0.0  # /health and /ready answer 503 for this long after binding
    seed: int = 0
    api_key: str | None = None
    reasoning_parser: str | None = None
    version: str = "0.5.23"
    model_path: str = "fake-org/fake-model"
    # SGLang's --preferred-sampling-params: reported by /model_info and merged into every request for the keys
    # it leaves out, as SGLang does ({**preferred_sampling_params, **sampling_params})
    preferred_sampling_params: dict[str, Any] | None = None
    leak_prompt_tail: float = 0.0  # prepend the last 5 prompt ids to output_ids
    wrong_completion_tokens: float = 0.0  # completion_tokens = true count + 1
    drop_stop_token: float = 0.0  # remove the trailing stop id, still report stop/matched
    abort_rate: float = 0.0  # HTTP 200 with finish_reason {"type": "abort", ...} and partial output
    cache_size: int = 4096  # LRU entries of computed outputs
    tokenizer_path: str | None = None  # /v1/tokenize renders with this tokenizer (404 without one)
    chat_template: str | None = None  # /v1/tokenize renders with this template instead (like --chat-template)
    # Family mode: a ``Family.to_json()`` (eagle_datagen.record.family). Outputs are then shaped as that model
    # family writes them (reasoning opened where the template leaves it to the model, one think-close, harmony
    # channels for gpt-oss, the family's stop id) and the free text avoids its special ids.
    family: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.vocab_size < MIN_TOKEN_ID + 2:
            raise ValueError(f"vocab_size must be >= {MIN_TOKEN_ID + 2}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError("eos_id must be in [0, vocab_size)")
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError("need 1 <= output_len_min <= output_len_max")
        if self.fixed_output_len is not None and self.fixed_output_len < 1:
            raise ValueError("fixed_output_len must be >= 1")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError("capacity must be >= 1")
        for name in _RATE_FIELDS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")


_RATE_FIELDS = (
    "error_503_rate",
    "error_429_rate",
    "drop_rate",
    "leak_prompt_tail",
    "wrong_completion_tokens",
    "drop_stop_token",
    "abort_rate",
)
_OUTPUT_FIELDS = frozenset(
    {"vocab_size", "eos_id", "output_len_min", "output_len_max", "fixed_output_len", "context_length", "family"}
)


class RequestError(ValueError):
    """A request the fake rejects: HTTP status plus JSON body."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body!r}")
        self.status = status
        self.body = body


class _OutOfVocab(Exception):
    """An input id the model cannot embed: SGLang crashes."""


def _err_a(msg: str) -> RequestError:
    return RequestError(400, {"error": msg})


def _err_b(msg: str) -> RequestError:
    return RequestError(400, {"error": {"message": msg}})


def _err_d(msg: str) -> RequestError:
    return RequestError(400, {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400})


# ----------------------------------------------------------------------------------------------------
# Sampling parameters and the deterministic output model
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sampling:
    max_new_tokens: int | None  # None: up to the context limit (JSON null)
    explicit_max: bool
    min_new_tokens: int
    ignore_eos: bool
    stop_ids: tuple[int, ...]
    key: bytes  # the params that shape the token stream


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "floating point"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "map"


def _check_types(sp: Mapping[str, Any]) -> None:
    """Shape-A checks: unknown keys and strict JSON types."""
    for key, value in sp.items():
        if key not in _SAMPLING_KEY_SET:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise _err_a(f"unknown field `{key}`, expected one of {expected}")
        if value is None:
            continue
        bad = (
            (key in _INT_KEYS and (type(value) is not int))
            or (key in _FLOAT_KEYS and type(value) not in (int, float))
            or (key in _BOOL_KEYS and type(value) is not bool)
            or (key == "stop_token_ids" and not (isinstance(value, list) and all(type(v) is int for v in value)))
        )
        if bad:
            raise _err_a(f"invalid type: {_json_type(value)} `{value}` for `{key}` in sampling_params")


def _num(sp: Mapping[str, Any], key: str, default: float) -> float:
    value = sp.get(key)
    return default if value is None else float(value)


def _check_values(sp: Mapping[str, Any]) -> None:
    """Shape-B checks, as in SamplingParams.verify."""
    top_p = _num(sp, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _err_b(f"top_p must be in (0, 1], got {top_p}.")
    temperature = _num(sp, "temperature", 1.0)
    if temperature < 0.0:
        raise _err_b(f"temperature must be non-negative, got {temperature}.")
    min_p = _num(sp, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise _err_b(f"min_p must be in [0, 1], got {min_p}.")
    top_k = sp.get("top_k")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise _err_b(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    rep = _num(sp, "repetition_penalty", 1.0)
    if not 0.0 < rep <= 2.0:
        raise _err_b(f"repetition_penalty must be in (0, 2], got {rep}.")
    for key in ("frequency_penalty", "presence_penalty"):
        value = _num(sp, key, 0.0)
        if not -2.0 <= value <= 2.0:
            raise _err_b(f"{key} must be in [-2, 2], got {value}.")
    mnt, min_new = sp.get("max_new_tokens"), sp.get("min_new_tokens") or 0
    if mnt is not None and mnt < 0:
        raise _err_b(f"max_new_tokens must be at least 0, got {mnt}.")
    if min_new < 0 or (mnt is not None and min_new > mnt):
        raise _err_b(f"min_new_tokens must be in [0, max_new_tokens({mnt})], got {min_new}.")
    if (sp.get("n") or 1) != 1:
        raise _err_b("fake_sglang does not support n > 1; send n copies with distinct rids.")


def parse_sampling(sp: Mapping[str, Any] | None) -> _Sampling:
    """Validate ``sampling_params`` like SGLang 0.5.23 (raises :class:`RequestError`) and normalise them."""
    sp = sp or {}
    _check_types(sp)
    _check_values(sp)
    temperature = _num(sp, "temperature", 1.0)
    top_k = sp.get("top_k")
    if temperature < 1e-6:
        temperature, top_k = 1.0, 1
    shaping = [
        temperature,
        _num(sp, "top_p", 1.0),
        top_k if top_k not in (None, -1) else 1 << 30,
        _num(sp, "min_p", 0.0),
        _num(sp, "frequency_penalty", 0.0),
        _num(sp, "presence_penalty", 0.0),
        _num(sp, "repetition_penalty", 1.0),
        sp.get("sampling_seed"),
    ]
    explicit = "max_new_tokens" in sp
    return _Sampling(
        max_new_tokens=sp["max_new_tokens"] if explicit else DEFAULT_MAX_NEW_TOKENS,
        explicit_max=explicit and sp["max_new_tokens"] is not None,
        min_new_tokens=sp.get("min_new_tokens") or 0,
        ignore_eos=bool(sp.get("ignore_eos")),
        stop_ids=tuple(sp.get("stop_token_ids") or ()),
        key=orjson.dumps(shaping),
    )


def _natural_len(config: FakeConfig, prompt_digest: bytes) -> int:
    if config.fixed_output_len is not None:
        return config.fixed_output_len
    span = config.output_len_max - config.output_len_min + 1
    return config.output_len_min + int.from_bytes(prompt_digest[:8], "little") % span


def _stream_ids(config: FakeConfig, seed: bytes, n: int) -> list[int]:
    """``n`` pseudo-random non-EOS ids in [MIN_TOKEN_ID, vocab_size)."""
    words = array("I", hashlib.shake_256(seed).digest(4 * n))
    mod = config.vocab_size - MIN_TOKEN_ID
    ids = [MIN_TOKEN_ID + w % mod for w in words]
    eos = config.eos_id
    if eos >= MIN_TOKEN_ID and eos in ids:
        alt = eos + 1 if eos + 1 < config.vocab_size else MIN_TOKEN_ID
        ids = [alt if i == eos else i for i in ids]
    return ids


def _first_stop(ids: list[int], stop_ids: Sequence[int], start: int) -> int:
    best = -1
    for stop in set(stop_ids):
        try:
            pos = ids.index(stop, start)
        except ValueError:
            continue
        best = pos if best < 0 else min(best, pos)
    return best


def _family_ids(config: FakeConfig, prompt: Sequence[int], digest: bytes, s: _Sampling) -> tuple[list[int], int]:
    """Family mode: the whole reply a model of ``config.family`` writes for this prompt, and its stop id."""
    from eagle_datagen.record.family import Family, expectation

    assert config.family is not None
    family = Family.from_json(config.family)
    avoid = family.special_ids() | {config.eos_id}
    safe = next(i for i in range(MIN_TOKEN_ID, config.vocab_size) if i not in avoid)
    seed = digest + s.key

    def text(part: bytes, n: int) -> list[int]:
        return [safe if i in avoid else i for i in _stream_ids(config, seed + part, max(1, n))]

    natural = _natural_len(config, digest)
    first, second = max(1, natural // 2), max(1, natural - natural // 2)
    expect = expectation(family, prompt)
    stops = sorted(family.stop_ids) or [config.eos_id]
    eos = config.eos_id if config.eos_id in family.stop_ids or not family.stop_ids else stops[0]
    h = family.harmony
    if expect == "harmony" and h is not None:
        ids = [h.channel, *h.channels["analysis"], h.message, *text(b"a", first), h.end, h.start, *h.role]
        ids += [h.channel, *h.channels["final"], h.message, *text(b"f", second), h.return_]
        return ids, h.return_
    if expect in ("inside", "must_open") and family.think_close is not None and family.think_open is not None:
        head: list[int] = []
        if expect == "must_open":
            head = [*max(family.output_prefixes, key=len), family.think_open]
        return [*head, *text(b"r", first), family.think_close, *text(b"a", second), eos], eos
    return [*text(b"a", natural), eos], eos


def family_config(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``FakeConfig.family`` for a tokenizer: its family as :func:`detect_family` renders it (stop id: its EOS)."""
    from eagle_datagen.record.family import detect_family

    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return detect_family(tokenizer, template_kwargs, stop_ids=stops).to_json()


def _compute_family(config: FakeConfig, prompt: Sequence[int], s: _Sampling) -> tuple[list[int], dict[str, Any]]:
    digest = hashlib.blake2b(orjson.dumps(list(prompt)), digest_size=16).digest()
    cap = s.max_new_tokens
    if cap is None:
        cap = max(0, config.context_length - len(prompt) - 1)
    if cap == 0:
        return [], {"type": "length", "length": 0}
    ids, eos = _family_ids(config, prompt, digest, s)
    if s.ignore_eos or len(ids) < s.min_new_tokens:
        ids = [*ids, *_stream_ids(config, digest + b"more", max(0, cap - len(ids)))]
    ids = ids[:cap]
    if not s.ignore_eos:
        pos = _first_stop(ids, s.stop_ids, s.min_new_tokens) if s.stop_ids else -1
        if pos >= 0:
            return ids[: pos + 1], {"type": "stop", "matched": ids[pos]}
        end = len(ids) - 1
        if ids and ids[end] == eos and end >= s.min_new_tokens:
            return ids, {"type": "stop", "matched": eos}
    return ids, {"type": "length", "length": cap}


def _compute(config: FakeConfig, prompt: Sequence[int], s: _Sampling) -> tuple[list[int], dict[str, Any]]:
    if config.family is not None:
        return _compute_family(config, prompt, s)
    prompt_bytes = orjson.dumps(list(prompt))
    digest = hashlib.blake2b(prompt_bytes, digest_size=16).digest()
    eos_pos = max(_natural_len(config, digest) - 1, s.min_new_tokens)
    cap = s.max_new_tokens
    if cap is None:
        cap = max(0, config.context_length - len(prompt) - 1)
    if cap == 0:
        return [], {"type": "length", "length": 0}
    n = cap if s.ignore_eos else min(cap, eos_pos + 1)
    ids = _stream_ids(config, digest + s.key, n)
    if eos_pos < n:
        ids[eos_pos] = config.eos_id
    if not s.ignore_eos:
        pos = _first_stop(ids, s.stop_ids, s.min_new_tokens) if s.stop_ids else -1
        if pos >= 0:
            return ids[: pos + 1], {"type": "stop", "matched": ids[pos]}
        if eos_pos < n:
            return ids, {"type": "stop", "matched": config.eos_id}
    return ids, {"type": "length", "length": cap}


def expected_result(
    config: FakeConfig, input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None
) -> tuple[list[int], dict[str, Any]]:
    """The uncorrupted ``output_ids`` and ``finish_reason`` the fake returns for this prompt."""
    return _compute(config, input_ids, parse_sampling(sampling_params))


def expected_output(
    config: FakeConfig, input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None
) -> list[int]:
    """The ``output_ids`` the fake returns (absent fault/corruption knobs) for this prompt."""
    return expected_result(config, input_ids, sampling_params)[0]


def text_of(ids: Sequence[int], finish: Mapping[str, Any]) -> str:
    """The fake's ``text``: ids as decimal words, the matched stop token trimmed like SGLang."""
    if ids and finish.get("type") == "stop" and isinstance(finish.get("matched"), int):
        ids = ids[:-1]
    return " ".join(map(str, ids))


def prompt_from_text(config: FakeConfig, text: str) -> list[int]:
    """The fake's "tokenizer": one id per UTF-8 byte (used for ``text`` prompts and chat completions)."""
    mod = config.vocab_size - MIN_TOKEN_ID
    return [MIN_TOKEN_ID + b % mod for b in text.encode()]


# ----------------------------------------------------------------------------------------------------
# Minimal HTTP/1.1
# ----------------------------------------------------------------------------------------------------

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_MAX_HEAD = 65536
_CLOSE = "connection: close\r\n"


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    t0: float


class _HttpProtocol(asyncio.Protocol):
    """One connection: parse requests one at a time, hand them to the core."""

    def __init__(self, core: _Core) -> None:
        self.core = core
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: tuple[str, str, dict[str, str], int, bool, int] | None = None
        self.busy = False
        self.closed = False
        self.lost = False
        self.task: asyncio.Task[None] | None = None
        self.on_lost: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.core.conns.add(self)
        if self.core.server is None:
            # Accepted by the kernel just before the server went down: a dead server keeps no connection
            # (and one left open here would never be closed, which is a leaked socket at shutdown).
            self.abort()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self.process()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.lost = True
        self.core.conns.discard(self)
        if self.task is not None:
            self.task.cancel()
        if self.on_lost is not None:
            self.on_lost()

    def process(self) -> None:
        while not self.busy and not self.closed:
            req = self._next_request()
            if req is None:
                return
            self.core.dispatch(self, req)

    def _parse_head(self, end: int) -> bool:
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            return False
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if parts[2] == "HTTP/1.1" else conn == "keep-alive"
        self.head = (parts[0], parts[1], headers, length, keep, end + 4)
        return length >= 0 and "chunked" not in headers.get("transfer-encoding", "")

    def _next_request(self) -> _Request | None:
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self.send(431, b'{"detail":"Request header too large"}', False)
                return None
            if not self._parse_head(end):
                self.send(400, b'{"detail":"Bad request"}', False)
                return None
        assert self.head is not None
        method, path, headers, length, keep, start = self.head
        if len(self.buf) < start + length:
            return None
        body = bytes(self.buf[start : start + length])
        del self.buf[: start + length]
        self.head = None
        return _Request(method, path.split("?", 1)[0], headers, body, keep, time.monotonic())

    def send(
        self, status: int, body: bytes, keep_alive: bool, extra_head: str = "", content_type: str = "application/json"
    ) -> None:
        if self.closed or self.transport is None:
            return
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n{extra_head}{'' if keep_alive else _CLOSE}\r\n"
        )
        self.transport.write(head.encode() + body)
        if not keep_alive:
            self.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        # Also after a graceful close(): one still flushing to a peer that stopped reading never ends by itself.
        if not self.lost and self.transport is not None:
            self.closed = True
            self.transport.abort()


# ----------------------------------------------------------------------------------------------------
# Capacity slots and statistics
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    by_status: dict[str, int] = field(default_factory=dict)
    generate_by_status: dict[str, int] = field(default_factory=dict)
    generate_received: int = 0
    generate_items: int = 0
    generate_responses: int = 0
    output_tokens: int = 0
    dropped: int = 0
    faults_503: int = 0
    faults_429: int = 0
    queue_full: int = 0
    aborted_items: int = 0
    corrupted_items: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    busy: int = 0
    max_busy: int = 0
    waiting: int = 0
    max_waiting: int = 0
    busy_slot_seconds: float = 0.0
    busy_since: float = 0.0
    first_request_t: float | None = None
    last_response_t: float | None = None
    timeline: list[tuple[float, int]] = field(default_factory=list)
    timeline_truncated: bool = False
    crashes: int = 0
    crash_reason: str | None = None
    stalls: int = 0
    cache_hits: int = 0
    parser_calls: dict[str, int] = field(default_factory=dict)  # per parser route, every request counted

    def set_busy(self, delta: int) -> None:
        now = time.monotonic()
        self.busy_slot_seconds += self.busy * (now - self.busy_since)
        self.busy_since = now
        self.busy += delta
        self.max_busy = max(self.max_busy, self.busy)
        if len(self.timeline) < _TIMELINE_MAX:
            self.timeline.append((now, self.busy))
        else:
            self.timeline_truncated = True


class _Slots:
    """A FIFO counting semaphore whose limit may change (None = unlimited)."""

    def __init__(self, limit: int | None, stats: _Stats) -> None:
        self.limit = limit
        self.stats = stats
        self.waiters: deque[asyncio.Future[None]] = deque()

    def _free(self) -> bool:
        return self.limit is None or self.stats.busy < self.limit

    async def acquire(self) -> None:
        if self._free() and not self.waiters:
            self.stats.set_busy(1)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.stats.waiting += 1
        self.stats.max_waiting = max(self.stats.max_waiting, self.stats.waiting)
        try:
            await fut  # the releaser counts us busy before waking us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise
        finally:
            self.stats.waiting -= 1

    def release(self) -> None:
        self.stats.set_busy(-1)
        self.wake()

    def wake(self) -> None:
        while self.waiters and self._free():
            fut = self.waiters.popleft()
            if not fut.done():
                self.stats.set_busy(1)
                fut.set_result(None)


# ----------------------------------------------------------------------------------------------------
# The server core (runs on one event loop)
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    prompt: list[int]
    sampling: _Sampling
    rid: str


@dataclass
class _Job:
    proto: _HttpProtocol
    req: _Request
    items: list[_Item]
    batch: bool
    chat: bool = False
    return_prompt_ids: bool = False


Outcome = tuple[list[int], dict[str, Any], str]
_T = typing.TypeVar("_T")
Handler = Callable[[_HttpProtocol, _Request], None]


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


class _Core:
    """Routes, state and fault injection. Everything runs on ``loop``."""

    def __init__(self, config: FakeConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg = config
        self.host = _loopback(host)
        self.port = port
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.Server | None = None
        self.closing: asyncio.Server | None = None  # stopped accepting, closed on the next loop turn
        self.conns: set[_HttpProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stats = _Stats()
        self.slots = _Slots(config.capacity, self.stats)
        self.rng = random.Random(config.seed)
        self.cache: OrderedDict[tuple[bytes, _Sampling], Outcome] = OrderedDict()
        self.rids: set[str] = set()
        self.ready_at = 0.0
        self.stall_base = 0
        self.stall_until = 0.0
        self.stall_done = False
        self.crashed = False
        self.on_crash: Callable[[], None] | None = None
        self.come_up_handle: asyncio.TimerHandle | None = None
        self.started = time.time()
        self._tok: Any = None  # loaded by the first /v1/tokenize
        self._tok_path: str | None = None
        self.routes: dict[str, tuple[tuple[str, ...], Handler]] = {
            "/generate": (("POST", "PUT"), self._h_generate),
            "/v1/chat/completions": (("POST",), self._h_chat),
            "/v1/models": (("GET",), self._h_models),
            "/v1/tokenize": (("POST",), self._h_tokenize),
            "/separate_reasoning": (("POST",), self._h_separate_reasoning),
            "/parse_function_call": (("POST",), self._h_parse_function_call),
            "/health": (("GET",), self._h_health),
            "/health_generate": (("GET",), self._h_health),
            "/ready": (("GET",), self._h_ready),
            "/ping": (("GET",), self._h_ready),
            "/server_info": (("GET",), self._h_server_info),
            "/get_server_info": (("GET",), self._h_server_info),
            "/model_info": (("GET",), self._h_model_info),
            "/get_model_info": (("GET",), self._h_model_info),
            "/fake/stats": (("GET",), self._h_stats),
            "/fake/config": (("GET", "POST"), self._h_config),
            "/fake/restart": (("POST",), self._h_restart),
            "/fake/reset_stats": (("POST",), self._h_reset_stats),
        }

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.server is not None

    async def listen(self) -> int:
        """Bind (again) on host:port; the port chosen the first time is kept."""
        self.loop = asyncio.get_running_loop()
        while self.closing is not None:  # the last go-down's listening socket still holds the port
            await asyncio.sleep(0)
        if self.server is None:
            self.server = await self.loop.create_server(
                lambda: _HttpProtocol(self), self.host, self.port, reuse_address=True
            )
            self.port = self.server.sockets[0].getsockname()[1]
            self.ready_at = time.monotonic() + self.cfg.startup_delay_s
            self.crashed = False
        return self.port

    def go_down(self, spare: _HttpProtocol | None = None) -> None:
        """Stop listening and drop every connection (``spare`` is closed after its pending write)."""
        if self.server is not None:
            self._stop_accepting(self.server)
            self.server = None
        for proto in list(self.conns):
            if proto is spare:
                proto.close()
            else:
                proto.abort()

    def _stop_accepting(self, server: asyncio.Server) -> None:
        """Stop accepting now; close the server on the next loop turn.

        The loop makes the transport of a connection it accepted in a task, a turn later. If
        ``asyncio.Server.close()`` comes in between, that transport's ``Server._attach()`` fails (CPython asserts
        the server is open; the error is dropped silently outside debug mode) and the accepted socket is
        collected unclosed: the fake's leaked socket of the crash and restart tests. So the listening sockets'
        readers go at once (nothing more is accepted), and the server closes after the transports of what was
        already accepted exist; their ``connection_made`` finds the fake down and aborts them."""
        assert self.loop is not None
        for sock in server.sockets:
            self.loop.remove_reader(sock.fileno())
        self.closing = server

        def close() -> None:
            server.close()
            if self.closing is server:
                self.closing = None

        self.loop.call_soon(close)

    def restart_after(self, delay_s: float) -> None:
        self.go_down()
        if self.come_up_handle is not None:
            self.come_up_handle.cancel()
        assert self.loop is not None
        self.come_up_handle = self.loop.call_later(delay_s, lambda: self._spawn(self._come_up()))

    async def _come_up(self) -> None:
        self.come_up_handle = None
        await self.listen()

    async def shutdown(self) -> None:
        if self.come_up_handle is not None:
            self.come_up_handle.cancel()
        self.on_crash = None
        self.go_down()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        # Aborted transports close their sockets in a callback, and connections accepted just before the
        # go-down still have their transport made and aborted (each by a task of the loop's own): let all of
        # that run before the loop stops.
        for _ in range(3):
            await asyncio.sleep(0)
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=1.0)
        deadline = time.monotonic() + 1.0
        while self.conns and time.monotonic() < deadline:
            for proto in list(self.conns):
                proto.abort()
            await asyncio.sleep(0.01)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def crash(self, reason: str, spare: _HttpProtocol | None = None) -> None:
        """Simulate SGLang's process tree going away."""
        self.crashed = True
        self.stats.crashes += 1
        self.stats.crash_reason = reason
        hook = self.on_crash
        if hook is not None and spare is not None and not spare.lost:
            spare.on_lost, hook = hook, None  # exit once the last response is flushed
        self.go_down(spare)
        if hook is not None:
            hook()

    # -- config ------------------------------------------------------------------------------------

    def update_config(self, changes: Mapping[str, Any]) -> FakeConfig:
        names = {f.name for f in dataclasses.fields(FakeConfig)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"unknown FakeConfig fields: {unknown}")
        self.cfg = dataclasses.replace(self.cfg, **changes)
        if "seed" in changes:
            self.rng = random.Random(self.cfg.seed)
        if "capacity" in changes:
            self.slots.limit = self.cfg.capacity
            self.slots.wake()
        if "stall_after" in changes or "stall_s" in changes:
            self.stall_base, self.stall_done, self.stall_until = self.stats.generate_received, False, 0.0
        if _OUTPUT_FIELDS & set(changes):
            self.cache.clear()
        return self.cfg

    # -- dispatch ----------------------------------------------------------------------------------

    def dispatch(self, proto: _HttpProtocol, req: _Request) -> None:
        route = self.routes.get(req.path)
        if route is None:
            self.reply(proto, req, 404, {"detail": "Not Found"})
        elif req.method not in route[0]:
            self.reply(proto, req, 405, {"detail": "Method Not Allowed"})
        else:
            route[1](proto, req)

    def reply(self, proto: _HttpProtocol, req: _Request, status: int, obj: Any, generate: bool = False) -> None:
        self.send_raw(proto, req, status, obj if isinstance(obj, bytes) else _dumps(obj), generate)

    def send_raw(
        self,
        proto: _HttpProtocol,
        req: _Request,
        status: int,
        body: bytes,
        generate: bool,
        content_type: str = "application/json",
    ) -> None:
        key = str(status)
        self.stats.by_status[key] = self.stats.by_status.get(key, 0) + 1
        if generate:
            self.stats.generate_by_status[key] = self.stats.generate_by_status.get(key, 0) + 1
        retry_after = self.cfg.retry_after_s
        extra = f"retry-after: {retry_after}\r\n" if retry_after is not None and status in (429, 503) else ""
        proto.send(status, body, req.keep_alive, extra, content_type)

    def _authorized(self, req: _Request) -> bool:
        key = self.cfg.api_key
        if key is None:
            return True
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _draw(self, rate: float) -> bool:
        return rate > 0.0 and self.rng.random() < rate

    # -- health / info -----------------------------------------------------------------------------

    def _stalled(self) -> bool:
        return time.monotonic() < self.stall_until

    def _h_health(self, proto: _HttpProtocol, req: _Request) -> None:
        ok = time.monotonic() >= self.ready_at and not self._stalled()
        self.reply(proto, req, 200 if ok else 503, b"")

    def _h_ready(self, proto: _HttpProtocol, req: _Request) -> None:
        ok = time.monotonic() >= self.ready_at
        self.reply(proto, req, 200 if ok else 503, {"status": "ready" if ok else "starting"})

    def server_info(self) -> dict[str, Any]:
        cfg = self.cfg
        args = {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "served_model_name": cfg.model_path,
            "host": self.host,
            "port": self.port,
            "tp_size": cfg.tp_size,
            "dp_size": cfg.dp_size,
            "context_length": cfg.context_length,
            "skip_tokenizer_init": False,
            "reasoning_parser": cfg.reasoning_parser,
            "tool_call_parser": None,
            "chat_template": None,
            "max_running_requests": cfg.max_running_requests,
            "max_queued_requests": cfg.max_queued_requests,
            "preferred_sampling_params": (
                orjson.dumps(cfg.preferred_sampling_params).decode() if cfg.preferred_sampling_params else None
            ),
            "stream_interval": 1,
            "random_seed": cfg.seed,
            "enable_deterministic_inference": False,
        }
        state = {
            **args,
            "world_size": cfg.tp_size,
            "effective_max_running_requests_per_dp": cfg.max_running_requests,
            "last_gen_throughput": 0.0,
            "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": cfg.max_total_num_tokens},
        }
        return {
            **args,
            "launch_command": f"python -m sglang.launch_server --model-path {cfg.model_path}",
            "status": "ready",
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "max_req_input_len": cfg.max_req_input_len,
            "startup_time": self.started,
            "internal_states": [{**state, "dp_rank": rank} for rank in range(max(1, cfg.dp_size))],
            "version": cfg.version,
            "frontend": "python",
        }

    def _h_server_info(self, proto: _HttpProtocol, req: _Request) -> None:
        self.reply(proto, req, 200, self.server_info())

    def _h_model_info(self, proto: _HttpProtocol, req: _Request) -> None:
        cfg = self.cfg
        info = {
            "model_path": cfg.model_path,
            "served_model_name": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "is_generation": True,
            "preferred_sampling_params": cfg.preferred_sampling_params,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": cfg.reasoning_parser,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "fake",
            "architectures": ["FakeForCausalLM"],
        }
        self.reply(proto, req, 200, info)

    def _h_models(self, proto: _HttpProtocol, req: _Request) -> None:
        if not self._authorized(req):
            return self.reply(proto, req, 401, UNAUTHORIZED)
        model = {
            "id": self.cfg.model_path,
            "object": "model",
            "created": int(self.started),
            "owned_by": "sglang",
            "root": self.cfg.model_path,
            "max_model_len": self.cfg.context_length,
        }
        self.reply(proto, req, 200, {"object": "list", "data": [model]})

    # -- /v1/tokenize ------------------------------------------------------------------------------

    def _h_tokenize(self, proto: _HttpProtocol, req: _Request) -> None:
        """SGLang 0.5.23's /v1/tokenize: ``prompt`` encoded, or ``messages`` through the chat path (below)."""
        if not self._authorized(req):
            return self.reply(proto, req, 401, UNAUTHORIZED)
        if self.cfg.tokenizer_path is None:
            return self.reply(proto, req, 404, {"detail": "Not Found"})
        try:
            ids = _fake_tokenize(self._tokenizer(), self.cfg.chat_template, _load_object(req.body))
        except RequestError as exc:
            return self.reply(proto, req, exc.status, exc.body)
        self.reply(proto, req, 200, {"tokens": ids, "count": len(ids), "max_model_len": self.cfg.context_length})

    def _tokenizer(self) -> Any:
        if self._tok is None or self._tok_path != self.cfg.tokenizer_path:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.cfg.tokenizer_path, trust_remote_code=True)
            self._tok_path = self.cfg.tokenizer_path
        return self._tok

    # -- /separate_reasoning, /parse_function_call ------------------------------------------------

    def _h_separate_reasoning(self, proto: _HttpProtocol, req: _Request) -> None:
        self._parser_route(proto, req, fake_parsers.separate_reasoning)

    def _h_parse_function_call(self, proto: _HttpProtocol, req: _Request) -> None:
        self._parser_route(proto, req, fake_parsers.parse_function_call)

    def _parser_route(self, proto: _HttpProtocol, req: _Request, parse: Callable[[Any], dict[str, Any]]) -> None:
        """SGLang's native parser endpoints, on text (eagle_datagen.testing.fake_parsers)."""
        calls = self.stats.parser_calls
        calls[req.path] = calls.get(req.path, 0) + 1
        if not self._authorized(req):
            return self.reply(proto, req, 401, UNAUTHORIZED)
        try:
            body = parse(fake_parsers.decode_body(req.body))
        except fake_parsers.ParserRequestError as exc:
            if exc.body == fake_parsers.INTERNAL_ERROR:
                return self.send_raw(proto, req, exc.status, exc.body, False, "text/plain; charset=utf-8")
            return self.reply(proto, req, exc.status, exc.body)
        self.reply(proto, req, 200, body)

    # -- fake control ------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        st = self.stats
        data = {k: v for k, v in dataclasses.asdict(st).items() if k != "busy_since"}
        now = time.monotonic()
        data["busy_slot_seconds"] = st.busy_slot_seconds + st.busy * (now - st.busy_since)
        data.update(up=self.up, crashed=self.crashed, capacity=self.cfg.capacity, now=now, clock="monotonic")
        span = (st.last_response_t or 0.0) - (st.first_request_t or 0.0)
        cap = self.cfg.capacity
        data["utilisation"] = data["busy_slot_seconds"] / (cap * span) if cap and span > 0 else None
        return data

    def _h_stats(self, proto: _HttpProtocol, req: _Request) -> None:
        self.reply(proto, req, 200, self.snapshot())

    def _h_config(self, proto: _HttpProtocol, req: _Request) -> None:
        if req.method == "POST":
            try:
                changes = orjson.loads(req.body or b"{}")
                if not isinstance(changes, dict):
                    raise ValueError("body must be a JSON object")
                self.update_config(changes)
            except (ValueError, TypeError) as exc:
                return self.reply(proto, req, 400, {"error": str(exc)})
        self.reply(proto, req, 200, dataclasses.asdict(self.cfg))

    def _h_restart(self, proto: _HttpProtocol, req: _Request) -> None:
        try:
            delay = float(orjson.loads(req.body or b"{}").get("delay_s", 1.0))
        except (ValueError, TypeError, AttributeError) as exc:
            return self.reply(proto, req, 400, {"error": str(exc)})
        self.reply(proto, req, 200, {"restarting_in_s": delay})
        assert self.loop is not None
        self.loop.call_soon(self.restart_after, delay)

    def _h_reset_stats(self, proto: _HttpProtocol, req: _Request) -> None:
        old = self.stats
        self.stats = _Stats(in_flight=old.in_flight, busy=old.busy, waiting=old.waiting, busy_since=time.monotonic())
        self.slots.stats = self.stats
        self.reply(proto, req, 200, {"reset": True})

    # -- /generate ---------------------------------------------------------------------------------

    def _h_generate(self, proto: _HttpProtocol, req: _Request) -> None:
        st = self.stats
        st.generate_received += 1
        if st.first_request_t is None:
            st.first_request_t = req.t0
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        if not self._authorized(req):
            return self._end_error(proto, req, RequestError(401, UNAUTHORIZED))
        self._maybe_stall()
        if self._draw(self.cfg.drop_rate):
            st.dropped += 1
            st.in_flight -= 1
            return proto.close()
        try:
            items, batch, want_prompt = self._parse_generate(req.body)
        except RequestError as exc:
            return self._end_error(proto, req, exc)
        except _OutOfVocab as exc:
            st.in_flight -= 1
            return self.crash(str(exc))
        self._start_job(_Job(proto, req, items, batch, return_prompt_ids=want_prompt))

    def _start_job(self, job: _Job) -> None:
        if self._draw(self.cfg.error_503_rate):
            self.stats.faults_503 += 1
            return self._end_error(job.proto, job.req, RequestError(503, ERROR_503))
        if self._draw(self.cfg.error_429_rate):
            self.stats.faults_429 += 1
            return self._end_error(job.proto, job.req, RequestError(429, ERROR_429))
        cap, queued = self.cfg.capacity, self.cfg.max_queued_requests
        if cap is not None and queued is not None and self.stats.in_flight - 1 >= cap + queued:
            self.stats.queue_full += 1
            return self._end_error(job.proto, job.req, RequestError(503, ERROR_503))
        rids = [it.rid for it in job.items]
        dup = next((r for r in rids if r in self.rids), None)
        if dup is not None:
            return self._end_error(job.proto, job.req, _err_b(f"Duplicate request ID detected: {dup}"))
        self.rids.update(rids)
        self.stats.generate_items += len(job.items)
        cfg = self.cfg
        if cfg.capacity is None and cfg.latency_s == 0 and cfg.time_per_token_s == 0 and not self._stalled():
            self._finish(job, [self._outcome(it) for it in job.items])
        else:
            job.proto.busy = True
            job.proto.task = self._spawn(self._run_job(job))

    def _end_error(self, proto: _HttpProtocol, req: _Request, exc: RequestError) -> None:
        self.stats.in_flight -= 1
        self.reply(proto, req, exc.status, exc.body, generate=True)

    def _maybe_stall(self) -> None:
        cfg = self.cfg
        if cfg.stall_after is None or self.stall_done:
            return
        if self.stats.generate_received - self.stall_base > cfg.stall_after:
            self.stall_done = True
            self.stall_until = time.monotonic() + cfg.stall_s
            self.stats.stalls += 1

    async def _run_job(self, job: _Job) -> None:
        try:
            wait = self.stall_until - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            outcomes = await asyncio.gather(*(self._serve_item(it) for it in job.items))
        except asyncio.CancelledError:
            self.stats.in_flight -= 1
            self.rids.difference_update(it.rid for it in job.items)
            raise
        job.proto.task = None
        self._finish(job, list(outcomes))
        job.proto.busy = False
        job.proto.process()

    async def _serve_item(self, item: _Item) -> Outcome:
        outcome = self._outcome(item)
        await self.slots.acquire()
        try:
            service = self.cfg.latency_s + self.cfg.time_per_token_s * len(outcome[0])
            if service > 0:
                await asyncio.sleep(service)
        finally:
            self.slots.release()
        return outcome

    def _outcome(self, item: _Item) -> Outcome:
        key = (orjson.dumps(item.prompt), item.sampling)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            self.cache.move_to_end(key)
            return hit
        ids, finish = _compute(self.cfg, item.prompt, item.sampling)
        outcome = (ids, finish, text_of(ids, finish))
        self.cache[key] = outcome
        if len(self.cache) > self.cfg.cache_size:
            self.cache.popitem(last=False)
        return outcome

    def _finish(self, job: _Job, outcomes: list[Outcome]) -> None:
        st = self.stats
        st.in_flight -= 1
        self.rids.difference_update(it.rid for it in job.items)
        now = time.monotonic()
        st.last_response_t = now
        body: Any
        if job.chat:
            body = self._chat_body(job.items[0], outcomes[0])
        else:
            elapsed = now - job.req.t0
            results = [self._result(job, it, oc, elapsed) for it, oc in zip(job.items, outcomes, strict=True)]
            body = results if job.batch else results[0]
        self.reply(job.proto, job.req, 200, body, generate=True)
        st.generate_responses += 1
        limit = self.cfg.crash_after
        if limit is not None and st.generate_responses >= limit and not self.crashed:
            self.crash(f"crash_after={limit} responses", spare=job.proto)

    def _result(self, job: _Job, item: _Item, outcome: Outcome, elapsed: float) -> dict[str, Any]:
        ids, finish, text = outcome
        count = len(ids)
        ids, finish, count = self._corrupt(item, ids, finish, count)
        self.stats.output_tokens += len(ids)
        meta = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.prompt),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": count,
            "cached_tokens": 0,
            "e2e_latency": elapsed,
            "response_sent_to_client_ts": time.time(),
        }
        out: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if job.return_prompt_ids:
            out["prompt_token_ids"] = item.prompt
        return out

    def _corrupt(
        self, item: _Item, ids: list[int], finish: dict[str, Any], count: int
    ) -> tuple[list[int], dict[str, Any], int]:
        cfg = self.cfg
        if self._draw(cfg.abort_rate):
            self.stats.aborted_items += 1
            ids = ids[: len(ids) // 2]
            return (
                ids,
                {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
                len(ids),
            )
        corrupted = False
        if self._draw(cfg.drop_stop_token) and finish["type"] == "stop" and ids:
            ids, count, corrupted = ids[:-1], count - 1, True
        if self._draw(cfg.leak_prompt_tail):
            ids, corrupted = item.prompt[-LEAK_TAIL:] + ids, True
        if self._draw(cfg.wrong_completion_tokens):
            count, corrupted = count + 1, True
        self.stats.corrupted_items += corrupted
        return ids, finish, count

    # -- request parsing ---------------------------------------------------------------------------

    def _parse_generate(self, raw: bytes) -> tuple[list[_Item], bool, bool]:
        body = _load_object(raw)
        if body.get("stream"):
            raise _err_b("fake_sglang does not support stream=true.")
        prompts, batch = self._prompts(body)
        sps = body.get("sampling_params")
        preferred = self.cfg.preferred_sampling_params
        if preferred:
            if isinstance(sps, list):
                sps = [{**preferred, **sp} if isinstance(sp, dict) else sp for sp in sps]
            elif sps is None or isinstance(sps, dict):
                sps = {**preferred, **(sps or {})}
        if isinstance(sps, list):
            if not batch or len(sps) != len(prompts):
                raise _err_b("The length of sampling_params must match the batch size.")
            samplings = [parse_sampling(_as_map(sp)) for sp in sps]
        else:
            samplings = [parse_sampling(_as_map(sps))] * len(prompts)
        rids = _rids(body.get("rid"), len(prompts), batch)
        for prompt, s in zip(prompts, samplings, strict=True):
            self._check_lengths(prompt, s)
        for prompt in prompts:
            if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
                raise _OutOfVocab(f"input id out of vocabulary [0, {self.cfg.vocab_size})")
        items = [_Item(p, s, r) for p, s, r in zip(prompts, samplings, rids, strict=True)]
        return items, batch, bool(body.get("return_prompt_token_ids"))

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text")
            if isinstance(text, str):
                return [prompt_from_text(self.cfg, text)], False
            if isinstance(text, list) and all(isinstance(t, str) for t in text):
                return [prompt_from_text(self.cfg, t) for t in text], True
            raise _err_b("Either text, input_ids or input_embeds should be provided.")
        if not isinstance(ids, list):
            raise _err_a(f"invalid type: {_json_type(ids)} for `input_ids`, expected a list")
        if not ids:
            raise _err_b("input_ids cannot be empty.")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for prompt in prompts:
            if not isinstance(prompt, list) or type(sum(prompt)) is not int:
                raise _err_a("invalid type in `input_ids`, expected integers")
            if not prompt:
                raise _err_b("input_ids cannot be empty.")
        return prompts, batch

    def _check_lengths(self, prompt: list[int], s: _Sampling) -> None:
        n, ctx = len(prompt), self.cfg.context_length
        if n >= ctx:
            raise _err_b(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        mnt = s.max_new_tokens
        if s.explicit_max and mnt is not None and n + mnt > ctx:
            raise _err_b(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n + mnt} tokens: {n} tokens from the input messages and "
                f"{mnt} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        limit = self.cfg.max_req_input_len
        if n >= limit:
            raise _err_b(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({limit} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )

    # -- /v1/chat/completions ----------------------------------------------------------------------

    def _h_chat(self, proto: _HttpProtocol, req: _Request) -> None:
        st = self.stats
        st.generate_received += 1
        if st.first_request_t is None:
            st.first_request_t = req.t0
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        if not self._authorized(req):
            return self._end_error(proto, req, RequestError(401, UNAUTHORIZED))
        try:
            item = self._parse_chat(req.body)
            self._check_lengths(item.prompt, item.sampling)
        except RequestError as exc:
            return self._end_error(proto, req, exc)
        self._start_job(_Job(proto, req, [item], batch=False, chat=True))

    def _parse_chat(self, raw: bytes) -> _Item:
        body = _load_object(raw)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _err_d("messages must be a non-empty list")
        text = "".join(f"{m.get('role', '')}\n{m.get('content') or ''}\n" for m in messages if isinstance(m, dict))
        sp: dict[str, Any] = {}
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            sp["max_new_tokens"] = limit
        for key in ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos"):
            if body.get(key) is not None:
                sp[key] = body[key]
        prompt = prompt_from_text(self.cfg, text) or [MIN_TOKEN_ID]
        return _Item(prompt, parse_sampling(sp), f"chatcmpl-{uuid.uuid4().hex}")

    def _chat_body(self, item: _Item, outcome: Outcome) -> dict[str, Any]:
        ids, finish, text = outcome
        self.stats.output_tokens += len(ids)
        reason = "stop" if finish["type"] == "stop" else "length"
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None},
            "logprobs": None,
            "finish_reason": reason,
            "matched_stop": finish.get("matched"),
        }
        usage = {
            "prompt_tokens": len(item.prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(item.prompt) + len(ids),
        }
        return {
            "id": item.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model_path,
            "choices": [choice],
            "usage": usage,
        }


_FAKE_MESSAGE_KEYS = ("role", "content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools")


def _fake_tokenize(tokenizer: Any, template: str | None, body: dict[str, Any]) -> list[int]:
    """What SGLang's serving chat path does before the template, written from its source (serving_chat.py
    ``_apply_jinja_template``, protocol.py ``Tool``/``ToolCall``), independently of the client's copy: tool-call
    arguments given as strings parsed (strictly), tools dumped with ``defer_loading: null``, ``None`` keys
    dropped, text parts joined for tool results and for templates that take a string; then render to text and
    encode it without special tokens."""
    if "prompt" in body:
        return list(tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True)))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _err_d("Messages cannot be empty.")
    chat_template = template or tokenizer.chat_template
    loops_over_parts = isinstance(chat_template, str) and "in message.content" in chat_template.replace(
        "m.content", "message.content"
    )
    rendered_messages = []
    for message in messages:
        fields = ("role", "content") if message.get("role") == "user" else _FAKE_MESSAGE_KEYS
        out = {k: message[k] for k in fields if message.get(k) is not None}
        out.setdefault("content", "")
        calls = []
        for call in out.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = orjson.loads(args)
                except orjson.JSONDecodeError:
                    raise _err_d("Assistant tool call function.arguments must be valid JSON.") from None
                if not isinstance(args, dict):
                    raise _err_d("Assistant tool call function.arguments must be a JSON object.")
            calls.append({"id": call.get("id"), "index": call.get("index"), "type": "function",
                          "function": {"name": fn.get("name"), "arguments": args}})  # fmt: skip
        if calls:
            out["tool_calls"] = calls
        if isinstance(out["content"], list):
            texts = [p.get("text", "") if isinstance(p, dict) else p for p in out["content"]]
            if out["role"] == "tool" or not loops_over_parts:
                out["content"] = " ".join(texts)
            else:
                out.pop("content")
                out["content"] = [{"type": "text", "text": t} for t in texts]
        rendered_messages.append(out)
    tools = None
    if body.get("tools"):
        tools = []
        for tool in body["tools"]:
            fn = dict(tool.get("function") or {})
            dumped = {k: fn[k] for k in fn if k in ("description", "name", "parameters")}
            for k in ("description", "name", "parameters"):
                dumped.setdefault(k, None)
            tools.append({"type": tool.get("type", "function"), "function": dumped, "defer_loading": None})
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if template is not None:
        kwargs["chat_template"] = template
    try:
        text = tokenizer.apply_chat_template(
            rendered_messages, tools=tools, tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt") is not False, **kwargs,
        )  # fmt: skip
    except Exception as exc:
        raise _err_d(str(exc)) from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _load_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _err_d(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise _err_d("The request body must be a JSON object.")
    return body


def _as_map(sp: Any) -> Mapping[str, Any] | None:
    if sp is None or isinstance(sp, dict):
        return sp
    raise _err_a(f"invalid type: {_json_type(sp)} for `sampling_params`, expected a map")


def _rids(rid: Any, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if not batch or len(rid) != n:
            raise _err_b("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            raise _err_b("Duplicate request IDs detected within the batch.")
        return list(rid)
    raise _err_a(f"invalid type: {_json_type(rid)} for `rid`, expected a string or a list of strings")


def _loopback(host: str) -> str:
    """Only loopback is bound; anything else becomes 127.0.0.1."""
    if host == "::1" or host.startswith("127."):
        return host
    if host not in ("localhost", ""):
        print(f"fake_sglang: binding 127.0.0.1 instead of {host!r} (loopback only)", file=sys.stderr)
    return "127.0.0.1"


# ----------------------------------------------------------------------------------------------------
# In-process server
# ----------------------------------------------------------------------------------------------------


class FakeSGLangServer:
    """The fake on its own event loop in a daemon thread. Use as a context manager or start()/stop()."""

    def __init__(self, config: FakeConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._core = _Core(config or FakeConfig(), host, port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def config(self) -> FakeConfig:
        return self._core.cfg

    @property
    def port(self) -> int:
        return self._core.port

    @property
    def url(self) -> str:
        return f"http://{self._core.host}:{self._core.port}"

    @property
    def is_up(self) -> bool:
        return self._core.up

    def start(self) -> FakeSGLangServer:
        """Start the loop thread and listen; returns once the port is bound."""
        if self._loop is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-sglang", daemon=True)
        self._thread.start()
        self._call(self._core.listen())
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._call(self._core.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self._loop = self._thread = None

    def go_down(self) -> None:
        """Stop listening and close every connection (a dead server)."""
        self._run(self._core.go_down)

    def come_up(self) -> None:
        """Listen again on the same port."""
        self._call(self._core.listen())

    def restart_after(self, delay_s: float) -> None:
        """Go down now and come up on the same port after ``delay_s`` (returns at once)."""
        self._run(lambda: self._core.restart_after(delay_s))

    def update_config(self, **changes: Any) -> FakeConfig:
        """Change knobs at runtime (faults, capacity, latency, ...)."""
        return self._run(lambda: self._core.update_config(changes))

    def stats(self) -> dict[str, Any]:
        """Counters as served by ``GET /fake/stats``."""
        if self._loop is None:
            return self._core.snapshot()
        return self._run(self._core.snapshot)

    def server_info(self) -> dict[str, Any]:
        return self._run(self._core.server_info)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None, "server not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _run(self, fn: Callable[[], _T]) -> _T:
        async def wrapper() -> _T:
            return fn()

        return cast(_T, self._call(wrapper()))

    def __enter__(self) -> FakeSGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------------------
# Foreground server (subprocess mode, and the sglang.launch_server stand-in)
# ----------------------------------------------------------------------------------------------------


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(f"{port}\n")
    os.replace(tmp, path)


def _hard_exit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


async def serve_async(
    config: FakeConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    port_file: str | None = None,
    exit_on_crash: bool = True,
    on_listening: Callable[[int], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    on_signal: Callable[[int], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (0). A crash exits the process with 1 if asked."""
    core = _Core(config, host, port)
    if exit_on_crash:
        core.on_crash = _hard_exit
    bound = await core.listen()
    if port_file:
        _write_port_file(port_file, bound)
    if on_listening is not None:
        on_listening(bound)
    loop = asyncio.get_running_loop()
    if on_ready is not None:
        loop.call_later(config.startup_delay_s, on_ready)
    stop = asyncio.Event()
    got: list[int] = []

    def _on_signal(sig: int) -> None:
        got.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig)
    await stop.wait()
    if on_signal is not None:
        on_signal(got[0])
    await core.shutdown()
    return 0


def serve(config: FakeConfig, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> int:
    """Blocking :func:`serve_async`."""
    return asyncio.run(serve_async(config, host, port, **kwargs))


def _field_parser(tp: Any) -> Callable[[str], Any]:
    args = typing.get_args(tp)
    if not args:
        return cast(Callable[[str], Any], tp)
    inner = next(a for a in args if a is not type(None))
    conv = orjson.loads if typing.get_origin(inner) is dict else cast(Callable[[str], Any], inner)
    return lambda s: None if s.lower() in ("none", "null") else conv(s)


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m eagle_datagen.testing.fake_sglang",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", help="write the bound port to this file once listening")
    ap.add_argument("--config-json", help="FakeConfig fields as a JSON object (flags below override)")
    ap.add_argument("--no-exit-on-crash", action="store_true", help="on a simulated crash stay alive, not listening")
    hints = typing.get_type_hints(FakeConfig)
    for f in dataclasses.fields(FakeConfig):
        ap.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f"cfg_{f.name}",
            metavar=f.name.upper(),
            type=_field_parser(hints[f.name]),
            default=argparse.SUPPRESS,
            help=f"default {f.default!r}",
        )
    return ap


def config_from_args(args: argparse.Namespace) -> FakeConfig:
    values: dict[str, Any] = orjson.loads(args.config_json) if args.config_json else {}
    values.update({k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_")})
    return FakeConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    config = config_from_args(args)
    return serve(config, args.host, args.port, port_file=args.port_file, exit_on_crash=not args.no_exit_on_crash)


if __name__ == "__main__":
    sys.exit(main())
