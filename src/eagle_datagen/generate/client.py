"""Talking to SGLang's native API: ``/generate`` with token ids, server facts, health.

``/generate`` goes through :mod:`eagle_datagen.generate.transport` (keep-alive connections, no per-request
pool scan); the other endpoints use one ``httpx.AsyncClient`` with explicit limits and timeouts.
Every response is checked (:mod:`eagle_datagen.record.checks`) before it may become data.
"""

from __future__ import annotations

import email.utils
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from eagle_datagen.errors import RequestFailed, ServerError
from eagle_datagen.generate.transport import Transport, TransportError
from eagle_datagen.record.checks import RETRYABLE_KINDS, Problem, RecordSpec, check_record
from eagle_datagen.redaction import MASK


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """The parts of a /generate response that become a record."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    latency_s: float
    #: the record checks' warnings (:mod:`eagle_datagen.record.checks`): written, and counted
    warnings: tuple[Problem, ...] = ()


_INT = frozenset({int})


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The key travels only in the Authorization header, never in logs or the manifest."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_http_client(
    *, max_connections: int, request_timeout_s: float, api_key: str | None, tls: ssl.SSLContext
) -> httpx.AsyncClient:
    """The client for health and info endpoints: the run's one TLS context (:func:`connect.ssl_context`), the
    one the /generate transport uses too; no proxies (``trust_env=False``: :func:`connect.refuse_proxies`)."""
    headers = {"content-type": "application/json", **auth_headers(api_key)}
    return httpx.AsyncClient(
        headers=headers,
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx.Timeout(request_timeout_s, connect=30.0, pool=None),
        verify=tls,
        trust_env=False,
    )


def error_message(body: bytes) -> str:
    """SGLang's error text from any of its error body shapes."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace")
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(payload.get("message"), str):
            return str(payload["message"])
    return str(payload)[:500]


async def generate(
    transport: Transport,
    base_url: str,
    input_ids: Sequence[int],
    sampling_params: dict[str, Any],
    rid: str,
    *,
    timeout_s: float,
    spec: RecordSpec | None = None,
) -> GenerateResult:
    """One checked /generate call; raises :class:`RequestFailed` or :class:`ServerError`."""
    body = orjson.dumps({"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid})
    started = time.monotonic()
    try:
        response = await transport.post(base_url, "/generate", body, timeout_s)
    except TimeoutError as exc:
        raise RequestFailed("timeout", f"no response from {base_url} in {timeout_s:.0f} s", retryable=True) from exc
    except TransportError as exc:
        raise RequestFailed("connection", str(exc), retryable=exc.retryable) from exc
    status = response.status
    if status in (401, 403):
        raise ServerError(
            f"{base_url} answered {status} ({error_message(response.body)}); pass the server's key with --api-key "
            "or the EAGLE_DATAGEN_API_KEY environment variable"
        )
    if status != 200:
        retryable = status >= 500 or status in (408, 429)
        raise RequestFailed(
            f"http_{status}",
            error_message(response.body),
            retryable=retryable,
            status=status,
            retry_after_s=retry_after_s(response.header("retry-after")) if status in (429, 503) else None,
        )
    return parse_generate_response(response.body, input_ids, sampling_params, spec, time.monotonic() - started)


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header (delay-seconds or an HTTP-date, RFC 9110 §10.2.3) in seconds from now."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def parse_generate_response(
    content: bytes,
    input_ids: Sequence[int],
    sampling_params: dict[str, Any],
    spec: RecordSpec | None,
    latency_s: float,
) -> GenerateResult:
    """Validates a 200 body and applies the response checks."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise RequestFailed("bad_response", f"the response is not JSON ({exc})", retryable=True) from None
    if not isinstance(payload, dict):
        raise RequestFailed("bad_response", "the response is not a JSON object", retryable=True)
    output_ids = payload.get("output_ids")
    meta = payload.get("meta_info")
    # {int} ⊇ types: about half the CPU of all(type(i) is int ...) per 1,000 ids (bools still fail: type is bool).
    if not isinstance(output_ids, list) or not _INT.issuperset(map(type, output_ids)):
        raise RequestFailed("bad_response", "the response has no list of integer 'output_ids'", retryable=True)
    if not isinstance(meta, dict):
        raise RequestFailed("bad_response", "the response has no 'meta_info'", retryable=True)
    finish_reason = meta.get("finish_reason")
    completion_tokens = meta.get("completion_tokens")
    verdict = check_record(
        spec or RecordSpec(), input_ids, output_ids, finish_reason, completion_tokens,
        max_new_tokens=sampling_params.get("max_new_tokens"),
    )  # fmt: skip
    if verdict.errors:
        kind, message = verdict.errors[0]
        raise RequestFailed(f"check_{kind}", message, retryable=kind in RETRYABLE_KINDS)
    assert isinstance(finish_reason, dict) and isinstance(completion_tokens, int)
    return GenerateResult(
        output_ids=output_ids,
        finish_reason=finish_reason,
        completion_tokens=completion_tokens,
        prompt_tokens=meta.get("prompt_tokens"),
        cached_tokens=meta.get("cached_tokens"),
        latency_s=latency_s,
        warnings=tuple(verdict.warnings),
    )


def without_secrets(text: str, http: httpx.AsyncClient) -> str:
    """``text`` (an exception's message) with the client's Authorization value hidden, in any quoting."""
    auth = http.headers.get("authorization")
    if not auth:
        return text
    key = auth.partition(" ")[2] or auth
    for secret in (auth, key):
        for form in (secret, repr(secret)[1:-1], repr(secret.encode())[2:-1]):
            text = text.replace(form, MASK)
    return text


async def get_json(http: httpx.AsyncClient, base_url: str, *paths: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """GET the first of ``paths`` that answers 200 with a JSON object (new name, then deprecated alias)."""
    last = "no path given"
    for path in paths:
        try:
            response = await http.get(f"{base_url}{path}", timeout=timeout_s)
        except httpx.HTTPError as exc:
            last = f"{path}: {without_secrets(f'{type(exc).__name__}: {exc}', http)}"
            continue
        if response.status_code == 200:
            try:
                value = response.json()
            except ValueError:
                last = f"{path}: not JSON"
                continue
            if isinstance(value, dict):
                return value
        last = f"{path}: HTTP {response.status_code}"
    raise ServerError(f"{base_url} did not answer {' or '.join(paths)} ({last})")


async def is_healthy(
    http: httpx.AsyncClient, base_url: str, *, timeout_s: float = 30.0, path: str = "/health_generate"
) -> bool:
    """True when ``path`` answers 200 (``/health_generate`` runs a one-token generation)."""
    try:
        response = await http.get(f"{base_url}{path}", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
