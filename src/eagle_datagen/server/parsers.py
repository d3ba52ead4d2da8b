"""SGLang's own parsers, called explicitly: a generated reply as the assistant message serving would keep.

Multi-turn regeneration (issue 12) needs each generated turn as a history message for the next. The server runs
with no ``--reasoning-parser`` (the ids must stay raw), but its native endpoints still expose the parsers:

* ``POST /separate_reasoning`` ``{"text", "reasoning_parser"}`` → ``{"reasoning_text", "text"}``;
* ``POST /parse_function_call`` ``{"text", "tool_call_parser", "tools"}`` →
  ``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}`` (``parameters`` is the model's raw
  argument text).

Facts this module is built on (``../shared/docs/sglang-parsers.md``, and SGLang 0.5.23's
``entrypoints/http_server.py`` and ``openai/serving_chat.py``):

* The reasoning parsers look for the opening think tag in the text they get. When the prompt's tail opened
  reasoning (the template put ``<think>`` there), the output holds no opener, so the caller passes the
  prompt-side opener text as ``opened_by_prompt`` and it is put in front of the decoded output.
* The matched stop token is left out of the text (the parsers keep it in ``text`` otherwise).
* Tool-call ids follow SGLang's serving path where it is deterministic: ``kimi_k2`` →
  ``functions.{name}:{n}`` and ``kimi_k3`` → ``{name}:{n}``, ``n`` counting the calls earlier in the
  conversation. Every other parser gets a random ``call_…`` id from serving, which would make records differ
  between runs and break resume, so here the id comes from the caller's ``call_id`` (e.g. key, turn, index).
* With no ``tools`` the function-call parser finds nothing: the markup stays in the answer.
* An empty reasoning is ``null`` on the serving path (``reasoning_content`` left out of the message), except for
  ``k2_horizon``, whose templates replay an empty one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson

from eagle_datagen.errors import ServerError
from eagle_datagen.generate.transport import TransportError


@dataclass(frozen=True)
class ParsedReply:
    """A generated reply split as SGLang's parsers split it, and the assistant message built from it."""

    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The OpenAI-style assistant message, as a chat template receives history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def reply_text(
    tokenizer: Any,
    output_ids: Sequence[int],
    stop_ids: Sequence[int],
    *,
    opened_by_prompt: str = "",
) -> str:
    """The text the parsers get: the output decoded with special tokens kept, less a final stop token, with the
    prompt-side reasoning opener (``opened_by_prompt``) in front when the template opened reasoning."""
    ids = list(output_ids)
    if ids and ids[-1] in set(stop_ids):
        ids = ids[:-1]
    text: str = tokenizer.decode(ids, skip_special_tokens=False)
    return opened_by_prompt + text


#: Parsers whose empty reasoning serving still reports as ``""`` (``serving_chat.py``: "Only K2 templates replay
#: empty reasoning; other parsers report None"). For every other parser an empty reasoning is ``null``, so the
#: history message has no ``reasoning_content`` at all, and the template sees what a serving client sends back.
EMPTY_REASONING_KEPT = frozenset({"k2_horizon"})
#: A parser call is quick (text in, text out): an answer slower than this is a server in trouble.
PARSE_TIMEOUT_S = 120.0


async def parse_reply(
    http: httpx.AsyncClient | Poster,
    url: str,
    text: str,
    *,
    reasoning_parser: str | None,
    tool_call_parser: str | None,
    tools: Sequence[dict[str, Any]] | None,
    call_id: Callable[[int], str],
    earlier_calls: int = 0,
) -> ParsedReply:
    """Splits ``text`` with the server's parsers (either may be ``None``: that step is skipped)."""
    reasoning: str | None = None
    answer = text
    if reasoning_parser is not None:
        split = await _post(http, url, "/separate_reasoning", {"text": text, "reasoning_parser": reasoning_parser})
        reasoning, answer = split.get("reasoning_text") or "", str(split.get("text") or "")
        if not reasoning and reasoning_parser not in EMPTY_REASONING_KEPT:
            reasoning = None  # serving reports no reasoning as null, and a client sends it back so
    calls: list[dict[str, Any]] = []
    if tool_call_parser is not None and tools:
        parsed = await _post(
            http,
            url,
            "/parse_function_call",
            {"text": answer, "tool_call_parser": tool_call_parser, "tools": list(tools)},
        )
        answer = str(parsed.get("normal_text") or "")
        for found in parsed.get("calls") or []:
            index = int(found.get("tool_index", len(calls)))
            name = str(found.get("name") or "")
            calls.append(
                {
                    "id": _tool_call_id(tool_call_parser, name, earlier_calls + len(calls), call_id, index),
                    "type": "function",
                    "function": {"name": name, "arguments": str(found.get("parameters") or "")},
                }
            )
    return ParsedReply(reasoning, answer, calls)


def _tool_call_id(parser: str, name: str, count: int, call_id: Callable[[int], str], index: int) -> str:
    if parser == "kimi_k2":
        return f"functions.{name}:{count}"
    if parser == "kimi_k3":
        return f"{name}:{count}"
    return call_id(index)


class Poster(Protocol):
    """The run's own HTTP/1.1 client (:class:`eagle_datagen.generate.transport.Transport`): its pool and TLS."""

    async def post(self, base_url: str, path: str, body: bytes, timeout_s: float) -> Any: ...


async def _post(http: httpx.AsyncClient | Poster, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One parser call. With the run's :class:`Poster` (as every turn of a run calls them: httpx's pool costs ~10x
    more CPU per request, docs/performance.md), else through an ``httpx.AsyncClient``."""
    try:
        if isinstance(http, httpx.AsyncClient):
            answer = await http.post(f"{url}{path}", json=body)
            status, raw = answer.status_code, answer.content
        else:
            response = await http.post(url, path, orjson.dumps(body), PARSE_TIMEOUT_S)
            status, raw = response.status, response.body
    except (TimeoutError, httpx.HTTPError, TransportError, OSError) as exc:
        raise ServerError(f"{url}{path} could not be reached ({exc.__class__.__name__}: {exc})") from exc
    if status != 200:
        raise ServerError(
            f"{url}{path} answered {status}: {raw[:300].decode('utf-8', 'replace')}; check the parser name "
            "(SGLang's --reasoning-parser / --tool-call-parser choices)"
        )
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ServerError(f"{url}{path} answered with no JSON: {raw[:200]!r}") from exc
    if not isinstance(payload, dict):
        raise ServerError(f"{url}{path} answered {type(payload).__name__}, not an object")
    return payload
