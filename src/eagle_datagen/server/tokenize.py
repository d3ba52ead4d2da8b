"""Rendering through the server: SGLang's ``POST /v1/tokenize`` with ``messages``.

That endpoint runs the serving chat path (``OpenAIServingChat._process_messages``, the code behind
``/v1/chat/completions``; ``serving_tokenize.py`` in SGLang 0.5.23): tool-call arguments normalized, tools
validated and dumped, text parts joined, and Python encoders instead of Jinja for the families that have one.
Its ``tokens`` are the prompt a served request would run. :class:`ServerRenderer` gets them for prompt rows,
with the same interface as :class:`~eagle_datagen.inputs.render.Renderer` (``render_many``,
``render_chunks``), for ``--render server``, the preflight render-parity check and ``verify-shard
--server-url``.

Request: ``{"messages", "tools"?, "chat_template_kwargs"?, "add_generation_prompt": true}``. A server whose
chat path has no Jinja template refuses ``add_generation_prompt`` ("supported only with a Jinja chat
template"); the request is then sent without it, which renders as for a chat completion (our rows never end
with an assistant turn, so that also opens the assistant's turn).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import httpx
import orjson

from eagle_datagen.errors import BadInputError, ServerError
from eagle_datagen.inputs.prompts import SKIP_FIX, PromptRow
from eagle_datagen.inputs.render import Rendered

TOKENIZE_PATH = "/v1/tokenize"
_NO_JINJA = "supported only with a Jinja chat template"
_RETRIES = 3


class NoTokenizeEndpoint(ServerError):
    """The server has no ``/v1/tokenize`` that takes ``messages``."""


class ServerRenderer:
    """Renders prompt rows through one server's ``/v1/tokenize`` (``concurrency`` requests at a time)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        concurrency: int = 8,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.template_kwargs = dict(template_kwargs or {})
        self.concurrency = max(1, concurrency)
        headers = {"content-type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=self.concurrency),
            verify=tls if tls is not None else True,  # the run's one trust store (generate/connect.py)
            trust_env=False,
        )
        self._generation_prompt = True
        self._pool: ThreadPoolExecutor | None = None

    def body(self, row: PromptRow) -> dict[str, Any]:
        """The request for ``row``: its messages and tools as given (the server normalizes them itself)."""
        body: dict[str, Any] = {"messages": row.messages}
        if row.tools:
            body["tools"] = row.tools
        kwargs = {**self.template_kwargs, **row.template_kwargs} if row.template_kwargs else self.template_kwargs
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if self._generation_prompt:
            body["add_generation_prompt"] = True
        return body

    def tokenize(self, row: PromptRow, path: str = "<prompts>") -> list[int]:
        """The server's prompt ids for ``row``; a row its chat path refuses is a :class:`BadInputError`."""
        for attempt in range(_RETRIES + 1):
            try:
                response = self._http.post(self.url + TOKENIZE_PATH, content=orjson.dumps(self.body(row)))
            except httpx.HTTPError as exc:
                if attempt == _RETRIES:
                    raise ServerError(f"{self.url}{TOKENIZE_PATH} cannot be reached ({exc})") from exc
                time.sleep(0.5 * 2**attempt)
                continue
            status = response.status_code
            if status == 200:
                return _tokens(response.content, self.url)
            message = _error_message(response.content)
            if status == 400 and _NO_JINJA in message and self._generation_prompt:
                self._generation_prompt = False  # an encoder, not Jinja: render as for a chat completion
                continue
            if status in (400, 422):
                raise BadInputError(
                    path, row.line, "server_template_error", f"the server's chat path refused it: {message}", SKIP_FIX
                )
            if status in (401, 403):
                raise ServerError(f"{self.url}{TOKENIZE_PATH} answered {status}: pass the server's --api-key")
            if status in (404, 405):
                raise NoTokenizeEndpoint(
                    f"{self.url} has no {TOKENIZE_PATH} with messages (HTTP {status}); it needs SGLang 0.5.23 or later"
                )
            if attempt == _RETRIES:
                raise ServerError(f"{self.url}{TOKENIZE_PATH} answered HTTP {status}: {message}")
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def render_many(self, rows: Sequence[PromptRow], path: str = "<prompts>") -> list[Rendered]:
        """Like :meth:`Renderer.render_many`: ids per row, in order, or the row's :class:`BadInputError`."""

        def one(row: PromptRow) -> Rendered:
            try:
                return self.tokenize(row, path)
            except BadInputError as exc:
                return exc

        if len(rows) <= 1:
            return [one(row) for row in rows]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="eagle-datagen-tokenize")
        futures = [self._pool.submit(one, row) for row in rows]
        wait(futures)  # all of them, also when one failed: none is left holding a connection
        return [f.result() for f in futures]

    def render_chunks(self, chunks: Iterable[Sequence[PromptRow]], path: str = "<prompts>") -> Iterator[list[Rendered]]:
        for chunk in chunks:
            yield self.render_many(chunk, path)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> ServerRenderer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tokens(body: bytes, url: str) -> list[int]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ServerError(f"{url}{TOKENIZE_PATH} answered without a list of token ids: {body[:200]!r}")
    return tokens


def _error_message(body: bytes) -> str:
    """SGLang's error text: ``{"message": ...}`` (OpenAI style), ``{"error": ...}``, ``{"detail": ...}``."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace")
    if isinstance(payload, dict):
        for key in ("message", "error", "detail"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if isinstance(value, str):
                return value
            if value is not None:
                return orjson.dumps(value).decode()[:500]
    return body[:500].decode("utf-8", "replace")
