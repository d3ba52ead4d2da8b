"""SGLang 0.5.23's ``POST /separate_reasoning`` and ``POST /parse_function_call``, on text, for the fake server.

Written from SGLang's source (``entrypoints/http_server.py``, ``managers/io_struct.py``
``SeparateReasoningReqInput``/``ParseFunctionCallReq``, ``parser/reasoning_parser.py``,
``function_call/function_call_parser.py``, ``kimik2_detector.py``, ``qwen25_detector.py``,
``base_format_detector.py``) and checked against it by ``tests/test_fake_sglang.py`` (``sglang`` mark), which
sends the same requests to SGLang's own FastAPI app:

* ``/separate_reasoning`` ``{"text", "reasoning_parser", "return_blocks"?}`` → ``{"reasoning_text", "text"}``
  (plus ``reasoning_blocks``, ``text_blocks``, ``blocks`` with ``return_blocks``). The think-tag parsers
  (``qwen3``, ``kimi_k2``, ``glm45``, ``deepseek-r1``, …) look for the opener in the text: without it (and
  without ``force_reasoning``, which ``deepseek-r1`` and ``qwen3-thinking`` have) there is no reasoning; with no
  closer everything after the opener is reasoning, up to the parser's tool-start token if it has one.
* ``/parse_function_call`` ``{"text", "tool_call_parser", "tools"}`` → ``{"normal_text", "calls": [{"tool_index",
  "name", "parameters"}]}``. With no ``tools`` nothing is parsed. ``kimi_k2``: ``parameters`` is the model's raw
  argument text, ``tool_index`` counts the calls of this text, names are taken from the call id whether or not a
  tool has that name. ``qwen25``: ``arguments`` re-serialised by ``json.dumps(..., ensure_ascii=False)``,
  ``tool_index`` is the tool's position in ``tools``, calls of unknown functions are dropped, and ``normal_text``
  is the stripped text before the first call (text after the calls is dropped).
* Errors as the real server answers them: a body that fails validation is 400 in SGLang's ``ErrorResponse``
  shape (the message lists the errors; SGLang's also carries a traceback line, left out here); an unknown parser
  name (or none) is SGLang's unhandled ``ValueError``, a plain-text 500 ``Internal Server Error``; a DeepSeek-V4
  parser name is 400, as on a server that does not serve that model. Parser names SGLang knows but this fake does
  not implement are 400 with a message saying so (the real server would parse them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

INTERNAL_ERROR = b"Internal Server Error"  # Starlette's answer to an unhandled exception (text/plain)


class ParserRequestError(Exception):
    """An answer other than 200: status and JSON body, or ``INTERNAL_ERROR`` (plain text) for a 500."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body!r}")
        self.status = status
        self.body = body


def _internal_error() -> ParserRequestError:
    return ParserRequestError(500, INTERNAL_ERROR)


def _bad_request(message: str, type_: str = "Bad Request") -> ParserRequestError:
    return ParserRequestError(400, {"object": "error", "message": message, "type": type_, "param": None, "code": 400})


# ----------------------------------------------------------------------------------------------------
# Parser names
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThinkFormat:
    """A ``BaseReasoningFormatDetector`` as ``parse_non_stream`` uses it."""

    start: str = "<think>"
    end: str = "</think>"
    force: bool = False  # reasoning from the first character, opener or not
    tool_start: str | None = None  # a tool section that ends unclosed reasoning
    append_think: bool = False  # minimax-append-think: no split, the opener put in front of the text


_QWEN3 = ThinkFormat(tool_start="<tool_call>")
_R1 = ThinkFormat(force=True)
# ReasoningParser.DetectorMap entries whose non-streaming parse is the base detector's (names lower-cased, as
# ReasoningParser looks them up).
REASONING_PARSERS: dict[str, ThinkFormat] = {
    "deepseek-r1": _R1,
    "step3": _R1,
    "step3p5": _R1,
    "gigachat35": _R1,
    "qwen3": _QWEN3,
    "dots": _QWEN3,
    "nanbeige": _QWEN3,
    "interns1": _QWEN3,
    "deepseek-v3": _QWEN3,
    "mimo": _QWEN3,
    "poolside_v1": _QWEN3,
    "qwen3-thinking": ThinkFormat(force=True, tool_start="<tool_call>"),
    "minimax": ThinkFormat(force=True, tool_start="<tool_call>"),
    "glm45": ThinkFormat(tool_start="<tool_call>"),
    "nemotron_3": ThinkFormat(tool_start="<tool_call>"),
    "kimi_k2": ThinkFormat(tool_start="<|tool_calls_section_begin|>"),
    "kimi": ThinkFormat(start="\u25c1think\u25b7", end="\u25c1/think\u25b7"),
    "mistral": ThinkFormat(start="[THINK]", end="[/THINK]"),
    "minimax-append-think": ThinkFormat(append_think=True),
}
# Every name SGLang 0.5.23 accepts (ReasoningParser.DetectorMap, FunctionCallParser.ToolCallParserEnum): a name
# outside these is the real server's 500, one inside them that the fake does not parse is the fake's 400.
SGLANG_REASONING_PARSERS = frozenset(
    {
        "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41", "dots", "glm45",
        "ling3", "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "mimo", "muse", "poolside_v1",
        "qwen3", "qwen3-thinking", "minimax", "minimax-append-think", "minimax-m3", "nanbeige", "step3",
        "step3p5", "mistral", "nemotron_3", "granite_thinking_parser", "interns1", "gemma4", "gigachat35",
        "inkling", "iquest_q1", "cohere_command4", "response_template",
    }
)  # fmt: skip
SGLANG_TOOL_CALL_PARSERS = frozenset(
    {
        "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4",
        "deepseekv41", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2",
        "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse", "poolside_v1", "pythonic", "qwen", "qwen25",
        "qwen3_coder", "spark25", "step3", "step3p5", "minimax-m2", "minimax-m3", "nanbeige", "trinity",
        "interns1", "hermes", "hunyuan", "gigachat3", "gigachat35", "gemma4", "inkling", "iquest_q1",
        "response_template",
    }
)  # fmt: skip
# chat_encoding_adapters.ADAPTER_OUTPUT_PARSERS: parsed with the served model's own tokenizer, refused (400)
# by a server that does not serve that model (the fake serves none).
ADAPTER_PARSERS = frozenset({"deepseek-v4", "deepseekv4", "deepseek-v41", "deepseekv41"})


def _check_adapter(name: str | None) -> None:
    if name in ADAPTER_PARSERS:
        raise _bad_request(
            f"{name!r} output is parsed with its model's tokenizer; this server does not serve that model", "400"
        )


def _not_implemented(kind: str, name: str, implemented: list[str]) -> ParserRequestError:
    return _bad_request(
        f"fake_sglang does not implement the {kind} {name!r} (SGLang 0.5.23 has it); it implements "
        f"{', '.join(implemented)}"
    )


# ----------------------------------------------------------------------------------------------------
# Request validation (pydantic's lax mode on SGLang's msgspec request structs)
# ----------------------------------------------------------------------------------------------------

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_Errors = list[dict[str, Any]]


def _error(errors: _Errors, type_: str, loc: tuple[Any, ...], msg: str) -> None:
    errors.append({"type": type_, "loc": ("body", *loc), "msg": msg})


def _string(
    errors: _Errors, body: Mapping[str, Any], key: str, loc: tuple[Any, ...], *, required: bool, optional: bool
) -> None:
    if key not in body:
        if required:
            _error(errors, "missing", (*loc, key), "Field required")
        return
    value = body[key]
    if not isinstance(value, str) and not (optional and value is None):
        _error(errors, "string_type", (*loc, key), "Input should be a valid string")


def _boolean(errors: _Errors, body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if isinstance(value, bool):
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    _error(errors, "bool_parsing", (key,), "Input should be a valid boolean, unable to interpret input")
    return False


def _object(errors: _Errors, value: Any, loc: tuple[Any, ...]) -> bool:
    if isinstance(value, dict):
        return True
    _error(errors, "dict_type", loc, "Input should be a valid dictionary")
    return False


def _base_req(errors: _Errors, body: Mapping[str, Any]) -> None:
    for key in ("rid", "http_worker_ipc"):
        _string(errors, body, key, (), required=False, optional=True)


def _tools(errors: _Errors, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        _error(errors, "list_type", ("tools",), "Input should be a valid list")
        return []
    for i, tool in enumerate(tools):
        if not _object(errors, tool, ("tools", i)):
            continue
        _string(errors, tool, "type", ("tools", i), required=False, optional=False)
        if "function" not in tool:
            _error(errors, "missing", ("tools", i, "function"), "Field required")
            continue
        function = tool["function"]
        if not _object(errors, function, ("tools", i, "function")):
            continue
        for key in ("description", "name"):
            _string(errors, function, key, ("tools", i, "function"), required=False, optional=True)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            _error(errors, "dict_type", ("tools", i, "function", "parameters"), "Input should be a valid dictionary")
    return tools


def _validation_body(errors: _Errors) -> tuple[int, dict[str, Any]]:
    n = len(errors)
    lines = "".join(f"\n  {e!r}" for e in errors)
    return 400, _bad_request(f"{n} validation error{'s' if n > 1 else ''}:{lines}").body


def _raise_if(errors: _Errors) -> None:
    if errors:
        raise ParserRequestError(*_validation_body(errors))


def decode_body(raw: bytes) -> Any:
    """The request body as FastAPI hands it to validation: ``None`` when empty, else the decoded JSON."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = f"JSON decode error ({exc})"
        raise ParserRequestError(
            *_validation_body([{"type": "json_invalid", "loc": ("body", 0), "msg": msg}])
        ) from None


def _request(raw: Any) -> Mapping[str, Any]:
    if raw is None:
        _raise_if([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    errors: _Errors = []
    _object(errors, raw, ())
    _raise_if(errors)
    return dict(raw)


# ----------------------------------------------------------------------------------------------------
# /separate_reasoning
# ----------------------------------------------------------------------------------------------------


def split_reasoning(fmt: ThinkFormat, text: str) -> tuple[str, str]:
    """``(reasoning_text, text)`` as ``ReasoningParser.parse_non_stream`` gives them (no streaming state,
    no ``continue_final_message``)."""
    if fmt.append_think:
        return "", fmt.start + text
    if not (fmt.force or fmt.start in text):
        return "", text
    rest = text
    while rest.startswith(fmt.start):
        rest = rest[len(fmt.start) :]
    if fmt.end not in rest:
        at = rest.find(fmt.tool_start) if fmt.tool_start else -1
        if at != -1:
            return rest[:at], rest[at:]
        return rest, ""  # truncated before the closer: all reasoning
    reasoning, _, answer = rest.partition(fmt.end)
    return reasoning, answer


def separate_reasoning(raw: Any) -> dict[str, Any]:
    """The body of SGLang's ``/separate_reasoning`` answer for the decoded request ``raw`` (raises
    :class:`ParserRequestError` for any other answer)."""
    body = _request(raw)
    errors: _Errors = []
    _base_req(errors, body)
    _string(errors, body, "text", (), required=True, optional=False)
    _string(errors, body, "reasoning_parser", (), required=True, optional=False)
    blocks_wanted = _boolean(errors, body, "return_blocks")
    _raise_if(errors)
    name: str = body["reasoning_parser"]
    _check_adapter(name)
    if not name or name.lower() not in SGLANG_REASONING_PARSERS:
        raise _internal_error()  # ReasoningParser: ValueError("Unsupported model type: ...")
    fmt = REASONING_PARSERS.get(name.lower())
    if fmt is None:
        raise _not_implemented("reasoning parser", name, sorted(REASONING_PARSERS))
    reasoning, answer = split_reasoning(fmt, body["text"])
    out: dict[str, Any] = {"reasoning_text": reasoning, "text": answer}
    if blocks_wanted:
        blocks = [{"type": "reasoning", "text": reasoning}] if reasoning else []
        blocks.append({"type": "text", "text": answer})
        out["reasoning_blocks"] = [b["text"] for b in blocks if b["type"] == "reasoning"]
        out["text_blocks"] = [b["text"] for b in blocks if b["type"] == "text"]
        out["blocks"] = blocks
    return out


# ----------------------------------------------------------------------------------------------------
# /parse_function_call
# ----------------------------------------------------------------------------------------------------

Call = dict[str, Any]  # ToolCallItem.model_dump(): tool_index, name, parameters


def _tool_indices(tools: list[dict[str, Any]]) -> dict[str, int]:
    return {t["function"]["name"]: i for i, t in enumerate(tools) if t["function"].get("name")}


_KIMI_SECTION = "<|tool_calls_section_begin|>"
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<tool_call_id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*"
    r"(?P<function_arguments>\{.*?\})\s*<\|tool_call_end\|>",
    re.DOTALL,
)
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
_KIMI_COUNTER = re.compile(r"^\d+$")


def _schema_properties(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, dict):
        return properties
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in _schema_properties(branch).items():
                    merged.setdefault(key, value)
    return merged


def _kimi_infer_name(tools: list[dict[str, Any]], args: str) -> str | None:
    """A bare-counter call id (``<|tool_call_begin|>3<|tool_call_argument_begin|>``): the tool whose schema
    best matches the argument keys."""
    if len(tools) == 1:
        name: str | None = tools[0]["function"].get("name")
        return name
    try:
        keys = set(json.loads(args).keys())
    except (json.JSONDecodeError, TypeError):
        return None
    best, best_score = None, -1
    for tool in tools:
        props = set(_schema_properties(tool["function"].get("parameters") or {}))
        if not props:
            continue
        score = len(keys & props) - len(keys - props)
        if score > best_score:
            best, best_score = tool["function"].get("name"), score
    return best


def _kimi_k2(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[Call]]:
    if _KIMI_SECTION not in text:
        return text, []
    calls: list[Call] = []
    for call_id, args in _KIMI_CALL.findall(text):
        m = _KIMI_ID.match(call_id)
        name = m.group("name") if m else _kimi_infer_name(tools, args) if _KIMI_COUNTER.match(call_id) else None
        if name is None:
            continue
        calls.append({"tool_index": len(calls), "name": name, "parameters": args})
    return text[: text.find(_KIMI_SECTION)], calls


_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>\n", "\n</tool_call>"
_QWEN_CALL = re.compile(rf"{re.escape(_QWEN_OPEN)}(.*?){re.escape(_QWEN_CLOSE)}", re.DOTALL)


def _qwen25(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[Call]]:
    at = text.find(_QWEN_OPEN)
    if at == -1:
        return text, []
    indices = _tool_indices(tools)
    calls: list[Call] = []
    for found in _QWEN_CALL.findall(text):
        try:
            parsed = json.loads(found.strip())
        except json.JSONDecodeError:
            continue
        # BaseFormatDetector.parse_base_json; anything but an object (or a list of them) raises there, which the
        # real server answers with a 500 (see _parse_function_call)
        for act in parsed if isinstance(parsed, list) else [parsed]:
            name = act.get("name")
            if not (name and name in indices):
                continue  # "Model attempted to call undefined function" (SGLANG_FORWARD_UNKNOWN_TOOLS unset)
            args = act.get("parameters") or act.get("arguments", {})
            calls.append(
                {"tool_index": indices[name], "name": name, "parameters": json.dumps(args, ensure_ascii=False)}
            )
    return text[:at].strip(), calls


# name → (detect_and_parse, has_tool_call marker)
TOOL_CALL_PARSERS: dict[str, tuple[Callable[[str, list[dict[str, Any]]], tuple[str, list[Call]]], str]] = {
    "kimi_k2": (_kimi_k2, _KIMI_SECTION),
    "qwen25": (_qwen25, _QWEN_OPEN),
    "qwen": (_qwen25, _QWEN_OPEN),
}


def parse_function_call(raw: Any) -> dict[str, Any]:
    """The body of SGLang's ``/parse_function_call`` answer for the decoded request ``raw`` (raises
    :class:`ParserRequestError` for any other answer)."""
    body = _request(raw)
    errors: _Errors = []
    _base_req(errors, body)
    _string(errors, body, "text", (), required=True, optional=False)
    tools = _tools(errors, body)
    _string(errors, body, "tool_call_parser", (), required=False, optional=True)
    _raise_if(errors)
    name = body.get("tool_call_parser")
    _check_adapter(name)
    if name not in SGLANG_TOOL_CALL_PARSERS:
        raise _internal_error()  # FunctionCallParser: ValueError("Unsupported tool_call_parser: ...")
    assert isinstance(name, str)
    parser = TOOL_CALL_PARSERS.get(name)
    if parser is None:
        raise _not_implemented("tool-call parser", name, sorted(TOOL_CALL_PARSERS))
    text: str = body["text"]
    if not tools:
        return {"normal_text": text, "calls": []}
    detect, marker = parser
    try:
        normal, calls = detect(text, tools)
    except (AttributeError, TypeError):
        raise _internal_error() from None
    if calls or marker in text:
        return {"normal_text": normal, "calls": calls}
    return {"normal_text": text, "calls": []}
