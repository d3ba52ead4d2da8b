"""Tests of the fake SGLang server (eagle_datagen.testing.fake_sglang) and the launch_server stand-in."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle_datagen.testing.fake_sglang import (
    ERROR_503,
    FakeConfig,
    FakeSGLangServer,
    expected_output,
    expected_result,
    text_of,
)

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "standin"
PROMPT = [11, 12, 13, 14, 15]


_HTTP = httpx.Client(timeout=10)  # one client: httpx.get/post would build a new SSL context per call


@pytest.fixture(scope="module", autouse=True)
def _close_http() -> Iterator[None]:
    yield
    _HTTP.close()


@pytest.fixture
def server() -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer(FakeConfig()) as srv:
        yield srv


def _gen(url: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return _HTTP.post(f"{url}/generate", json=body, **kw)


def test_response_shape_and_determinism(server: FakeSGLangServer) -> None:
    sp = {"max_new_tokens": 512, "temperature": 0.7, "top_p": 0.95}
    first = _gen(server.url, {"input_ids": PROMPT, "sampling_params": sp, "rid": "r1"}).json()
    again = _gen(server.url, {"input_ids": PROMPT, "sampling_params": sp, "rid": "r2"}).json()
    ids, finish = expected_result(server.config, PROMPT, sp)
    assert first["output_ids"] == again["output_ids"] == ids == expected_output(server.config, PROMPT, sp)
    assert set(first) == {"text", "output_ids", "meta_info"}
    meta = first["meta_info"]
    assert meta["id"] == "r1" and again["meta_info"]["id"] == "r2"
    assert meta["finish_reason"] == finish
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(ids)
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default" and meta["e2e_latency"] >= 0
    assert first["text"] == text_of(ids, finish)
    assert all(3 <= i < 1000 for i in ids[:-1])
    other = _gen(server.url, {"input_ids": PROMPT, "sampling_params": {**sp, "temperature": 0.5}}).json()
    assert other["output_ids"] != ids


def test_stop_token_kept_in_output_ids(server: FakeSGLangServer) -> None:
    out = _gen(server.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000}}).json()
    assert out["output_ids"][-1] == 2 and 2 not in out["output_ids"][:-1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    assert not out["text"].endswith(" 2")
    stop = out["output_ids"][3]
    sp = {"max_new_tokens": 1000, "stop_token_ids": [stop]}
    hit = _gen(server.url, {"input_ids": PROMPT, "sampling_params": sp}).json()
    assert hit["output_ids"][-1] == stop and len(hit["output_ids"]) <= 4
    assert hit["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_length_finish_and_default_cap() -> None:
    with FakeSGLangServer(FakeConfig(fixed_output_len=300)) as srv:
        capped = _gen(srv.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10}}).json()
        assert len(capped["output_ids"]) == 10 and 2 not in capped["output_ids"]
        assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        default = _gen(srv.url, {"input_ids": PROMPT, "max_new_tokens": 1000}).json()  # top-level: ignored
        assert len(default["output_ids"]) == 128
        assert default["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
        full = _gen(srv.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300}}).json()
        assert len(full["output_ids"]) == 300 and full["output_ids"][-1] == 2
        assert full["output_ids"][:10] == capped["output_ids"]
        zero = _gen(srv.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}).json()
        assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("key", ["seed", "max_tokens", "best_of"])
def test_unknown_sampling_key_is_400_shape_a(server: FakeSGLangServer, key: str) -> None:
    r = _gen(server.url, {"input_ids": PROMPT, "sampling_params": {key: 1}})
    assert r.status_code == 400
    assert r.json()["error"].startswith(f"unknown field `{key}`, expected one of `max_new_tokens`")


@pytest.mark.parametrize("key", ["max_new_tokens", "top_k", "min_new_tokens", "sampling_seed", "n"])
def test_float_for_int_is_400(server: FakeSGLangServer, key: str) -> None:
    r = _gen(server.url, {"input_ids": PROMPT, "sampling_params": {key: 3.0}})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    ok = _gen(server.url, {"input_ids": PROMPT, "sampling_params": {"temperature": 1, "top_p": 1}})
    assert ok.status_code == 200


def test_value_and_length_errors_are_400_shape_b() -> None:
    cfg = FakeConfig(max_req_input_len=50, context_length=100)
    with FakeSGLangServer(cfg) as srv:
        cases = {
            "Input length (50 tokens) exceeds the maximum allowed length (50 tokens)": ([5] * 50, 10),
            "Requested token count exceeds": ([5] * 40, 61),
            "input_ids cannot be empty.": ([], 10),
        }
        for msg, (ids, mnt) in cases.items():
            r = _gen(srv.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": mnt}})
            assert r.status_code == 400 and msg in r.json()["error"]["message"]
        assert _gen(srv.url, {"input_ids": [5] * 49, "sampling_params": {"max_new_tokens": 51}}).status_code == 200
        r = _gen(srv.url, {"input_ids": PROMPT, "sampling_params": {"top_p": 0}})
        assert r.json() == {"error": {"message": "top_p must be in (0, 1], got 0.0."}}
        assert _gen(srv.url, {"sampling_params": {}}).status_code == 400
        assert _HTTP.post(f"{srv.url}/generate", content=b"{nope").json()["type"] == "Bad Request"


def test_auth() -> None:
    with FakeSGLangServer(FakeConfig(api_key="sekret")) as srv:
        assert _gen(srv.url, {"input_ids": PROMPT}).status_code == 401
        bad = _gen(srv.url, {"input_ids": PROMPT}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json() == {"error": "Unauthorized"}
        assert _gen(srv.url, {"input_ids": PROMPT}, headers={"Authorization": "bearer sekret"}).status_code == 200
        assert _gen(srv.url, {"input_ids": PROMPT}, headers={"x-api-key": "sekret"}).status_code == 401
        for path in ("/health", "/health_generate", "/ready", "/server_info", "/model_info"):
            assert _HTTP.get(srv.url + path).status_code == 200


def test_503_rate_roughly_honoured() -> None:
    with FakeSGLangServer(FakeConfig(error_503_rate=0.3, seed=7)) as srv, httpx.Client(base_url=srv.url) as c:
        codes = [c.post("/generate", json={"input_ids": PROMPT}).status_code for _ in range(300)]
        n503 = codes.count(503)
        assert 60 <= n503 <= 120 and codes.count(200) == 300 - n503
        assert srv.stats()["faults_503"] == n503


def test_503_body_shape() -> None:
    with FakeSGLangServer(FakeConfig(error_503_rate=1.0)) as srv:
        r = _gen(srv.url, {"input_ids": PROMPT})
        assert r.status_code == 503 and r.json() == ERROR_503


def test_drop_is_a_connection_error() -> None:
    with FakeSGLangServer(FakeConfig(drop_rate=1.0)) as srv:
        with pytest.raises(httpx.TransportError):
            _gen(srv.url, {"input_ids": PROMPT})
        srv.update_config(drop_rate=0.0)
        assert _gen(srv.url, {"input_ids": PROMPT}).status_code == 200
        assert srv.stats()["dropped"] == 1


def test_capacity_limit_respected() -> None:
    cfg = FakeConfig(capacity=3, latency_s=0.05, fixed_output_len=10, time_per_token_s=0.001)
    with FakeSGLangServer(cfg) as srv, concurrent.futures.ThreadPoolExecutor(12) as pool:
        bodies = [{"input_ids": [*PROMPT, i], "rid": f"c{i}"} for i in range(12)]
        codes = list(pool.map(lambda b: _gen(srv.url, b).status_code, bodies))
        stats = srv.stats()
    assert codes == [200] * 12
    assert stats["max_busy"] == 3 and stats["max_in_flight"] > 3 and stats["max_waiting"] > 0
    assert 12 * 0.06 * 0.95 <= stats["busy_slot_seconds"] < 12 * 0.06 * 2
    assert 0.5 < stats["utilisation"] <= 1.0
    assert max(b for _, b in stats["timeline"]) == 3


def test_duplicate_in_flight_rid() -> None:
    with FakeSGLangServer(FakeConfig(latency_s=0.2)) as srv, concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_gen, srv.url, {"input_ids": PROMPT, "rid": "dup"})
        time.sleep(0.1)
        second = _gen(srv.url, {"input_ids": PROMPT, "rid": "dup"})
        assert second.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
        assert first.result().status_code == 200


def test_go_down_and_come_up_on_same_port(server: FakeSGLangServer) -> None:
    port = server.port
    with httpx.Client(base_url=server.url) as client:
        assert client.post("/generate", json={"input_ids": PROMPT}).status_code == 200
        server.go_down()
        with pytest.raises(httpx.ConnectError):
            client.get("/health")
        server.come_up()
        assert server.port == port
        assert client.post("/generate", json={"input_ids": PROMPT}).status_code == 200
        server.restart_after(0.15)
        with pytest.raises(httpx.ConnectError):
            client.get("/health")
        time.sleep(0.3)
        assert client.get("/health").status_code == 200


def test_out_of_vocab_input_crashes_server(server: FakeSGLangServer) -> None:
    with pytest.raises(httpx.TransportError):
        _gen(server.url, {"input_ids": [5, 1000]})
    stats = server.stats()
    assert stats["crashed"] and not stats["up"] and stats["crashes"] == 1
    with pytest.raises(httpx.ConnectError):
        _HTTP.get(server.url + "/health")


def test_batch_input_order(server: FakeSGLangServer) -> None:
    prompts = [[5, 6], [7, 8, 9], [10]]
    sps = [{"max_new_tokens": 3}, {"max_new_tokens": 500}, {"max_new_tokens": 7}]
    out = _gen(server.url, {"input_ids": prompts, "sampling_params": sps, "rid": ["a", "b", "c"]}).json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert [o["output_ids"] for o in out] == [
        expected_output(server.config, p, s) for p, s in zip(prompts, sps, strict=True)
    ]
    same = _gen(server.url, {"input_ids": prompts, "sampling_params": {"max_new_tokens": 9}, "rid": "x"}).json()
    assert [o["meta_info"]["id"] for o in same] == ["x_0", "x_1", "x_2"]


def test_corruption_knobs(server: FakeSGLangServer) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000}}
    ids = expected_output(server.config, PROMPT, body["sampling_params"])
    server.update_config(leak_prompt_tail=1.0)
    leaked = _gen(server.url, body).json()
    assert leaked["output_ids"] == PROMPT[-5:] + ids and leaked["meta_info"]["completion_tokens"] == len(ids)
    server.update_config(leak_prompt_tail=0.0, drop_stop_token=1.0)
    dropped = _gen(server.url, body).json()
    assert dropped["output_ids"] == ids[:-1] and dropped["meta_info"]["finish_reason"]["type"] == "stop"
    server.update_config(drop_stop_token=0.0, wrong_completion_tokens=1.0)
    assert _gen(server.url, body).json()["meta_info"]["completion_tokens"] == len(ids) + 1
    server.update_config(wrong_completion_tokens=0.0, abort_rate=1.0)
    aborted = _gen(server.url, body)
    assert aborted.status_code == 200 and aborted.json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_stall_and_info_endpoints() -> None:
    cfg = FakeConfig(stall_after=1, stall_s=0.25, reasoning_parser="qwen3", model_path="m/p")
    with FakeSGLangServer(cfg) as srv, httpx.Client(base_url=srv.url) as c:
        info = c.get("/get_server_info").json()
        assert info["version"] == "0.5.23" and info["reasoning_parser"] == "qwen3"
        assert info["max_req_input_len"] == 4096 and info["internal_states"][0]["tp_size"] == 1
        assert c.get("/get_model_info").json()["model_path"] == "m/p"
        assert c.post("/generate", json={"input_ids": PROMPT}).status_code == 200
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stalled = pool.submit(c.post, "/generate", json={"input_ids": PROMPT})
            time.sleep(0.1)
            assert _HTTP.get(srv.url + "/health_generate").status_code == 503
            assert stalled.result().status_code == 200
        assert time.monotonic() - t0 >= 0.2
        assert c.get("/health").status_code == 200
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["choices"][0]["finish_reason"] in ("stop", "length")


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"{path} not written")


def test_subprocess_mode_port_file_and_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    cmd = [sys.executable, "-m", "eagle_datagen.testing.fake_sglang", "--port", "0", "--port-file", str(port_file),
           "--config-json", '{"fixed_output_len": 5}', "--eos-id", "7", "--api-key", "none"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = int(_wait_for_file(port_file, proc))
        out = _gen(f"http://127.0.0.1:{port}", {"input_ids": PROMPT}).json()
        assert len(out["output_ids"]) == 5 and out["output_ids"][-1] == 7
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch_standin(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "org/m", "--port", str(port),
           "--reasoning-parser", "qwen3", "--mem-fraction-static", "0.8", "--some-unknown-flag", "x"]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(STANDIN), **env}
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, start_new_session=True)


def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert proc.poll() is None
        try:
            if _HTTP.get(url + "/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("stand-in never became ready")


def _kill_group(proc: subprocess.Popen[bytes]) -> bytes:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()[0]


def test_launch_server_standin_crashes_once(tmp_path: Path) -> None:
    env = {"FAKE_SGLANG_CRASH_AFTER": "2", "FAKE_SGLANG_STATE_DIR": str(tmp_path)}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch_standin(port, env)
    try:
        _wait_ready(url, proc)
        assert _HTTP.get(url + "/server_info").json()["reasoning_parser"] == "qwen3"
        assert [_gen(url, {"input_ids": PROMPT}).status_code for _ in range(2)] == [200, 200]
        assert proc.wait(5) == 1
    finally:
        log = _kill_group(proc)
    assert b"The server is fired up and ready to roll!" in log
    proc = _launch_standin(port, env)
    try:
        _wait_ready(url, proc)
        assert [_gen(url, {"input_ids": PROMPT}).status_code for _ in range(3)] == [200] * 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
    finally:
        _kill_group(proc)


# ----------------------------------------------------------------------------------------------------
# /separate_reasoning and /parse_function_call: one table of requests and SGLang 0.5.23's answers, checked
# against the fake here and against SGLang's own app below (sglang mark), so the fake cannot drift.
# ----------------------------------------------------------------------------------------------------

KEY = "parser-key"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {"city": {}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"properties": {"zone": {}}}}},
]
ONE_TOOL = TOOLS[:1]
KIMI_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def _kimi_calls(*calls: tuple[str, str]) -> str:
    inner = "".join(f"<|tool_call_begin|>{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>" for i, a in calls)
    return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"


def _qwen_call(obj: Any) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


class Invalid:
    """A 400 validation error whose message holds each fragment (SGLang's message also names its structs)."""

    def __init__(self, *fragments: str) -> None:
        self.fragments = fragments

    def __repr__(self) -> str:
        return f"Invalid{self.fragments}"


ISE = "Internal Server Error"  # a plain-text 500: SGLang's unhandled ValueError (unknown parser name)
SR, PF = "/separate_reasoning", "/parse_function_call"


def _sr(text: Any, parser: str, **extra: Any) -> dict[str, Any]:
    return {"text": text, "reasoning_parser": parser, **extra}


def _pf(text: str, parser: str | None, tools: Any = TOOLS, **extra: Any) -> dict[str, Any]:
    return {"text": text, "tool_call_parser": parser, "tools": tools, **extra}


def _rt(reasoning: str, text: str) -> dict[str, Any]:
    return {"reasoning_text": reasoning, "text": text}


def _calls(normal: str, *calls: tuple[int, str, str]) -> dict[str, Any]:
    return {"normal_text": normal, "calls": [{"tool_index": i, "name": n, "parameters": p} for i, n, p in calls]}


def _adapter(name: str) -> dict[str, Any]:
    message = f"'{name}' output is parsed with its model's tokenizer; this server does not serve that model"
    return {"object": "error", "message": message, "type": "400", "param": None, "code": 400}


# (path, body (bytes: sent as is), authorised, status, answer: JSON body, Invalid, or ISE)
PARSER_CASES: list[tuple[str, Any, bool, int, Any]] = [
    # The table of ../shared/docs/sglang-parsers.md: the parsers need the opener, except deepseek-r1 (forced).
    (SR, _sr("one plus two</think>three", "kimi_k2"), True, 200, _rt("", "one plus two</think>three")),
    (SR, _sr("<think>one plus two</think>three", "kimi_k2"), True, 200, _rt("one plus two", "three")),
    (SR, _sr("one plus two</think>three", "qwen3"), True, 200, _rt("", "one plus two</think>three")),
    (SR, _sr("<think>one plus two</think>three", "qwen3"), True, 200, _rt("one plus two", "three")),
    (SR, _sr("one plus two</think>three", "glm45"), True, 200, _rt("", "one plus two</think>three")),
    (SR, _sr("<think>one plus two</think>three", "glm45"), True, 200, _rt("one plus two", "three")),
    (SR, _sr("one plus two</think>three", "deepseek-r1"), True, 200, _rt("one plus two", "three")),
    (SR, _sr("<think>one plus two</think>three", "deepseek-r1"), True, 200, _rt("one plus two", "three")),
    # no closer: all reasoning, up to the parser's tool-start token
    (SR, _sr("<think>cut short", "kimi_k2"), True, 200, _rt("cut short", "")),
    (SR, _sr("cut short", "deepseek-r1"), True, 200, _rt("cut short", "")),
    (SR, _sr("<think>plan" + KIMI_CALL, "kimi_k2"), True, 200, _rt("plan", KIMI_CALL)),
    (SR, _sr("<think>plan<tool_call>\n{}", "qwen3"), True, 200, _rt("plan", "<tool_call>\n{}")),
    (SR, _sr("<think>plan<tool_call>\n{}", "deepseek-r1"), True, 200, _rt("plan<tool_call>\n{}", "")),
    # openers stripped only at the start, the first closer splits
    (SR, _sr("<think><think>a</think>b", "deepseek-r1"), True, 200, _rt("a", "b")),
    (SR, _sr("x<think>a</think>b", "qwen3"), True, 200, _rt("x<think>a", "b")),
    (SR, _sr("<think>a</think>b</think>c", "glm45"), True, 200, _rt("a", "b</think>c")),
    (SR, _sr("</think>b", "deepseek-r1"), True, 200, _rt("", "b")),
    (SR, _sr("a</think>b", "qwen3-thinking"), True, 200, _rt("a", "b")),
    (SR, _sr("<think>a</think>b<|im_end|>", "qwen3"), True, 200, _rt("a", "b<|im_end|>")),
    (SR, _sr("\u25c1think\u25b7a\u25c1/think\u25b7b", "kimi"), True, 200, _rt("a", "b")),
    (SR, _sr("[THINK]a[/THINK]b", "mistral"), True, 200, _rt("a", "b")),
    (SR, _sr("a</think>b", "minimax-append-think"), True, 200, _rt("", "<think>a</think>b")),
    (SR, _sr("<think>a</think>b", "KIMI_K2"), True, 200, _rt("a", "b")),  # looked up lower-cased
    (SR, _sr("<think>a</think>b", "qwen3", extra=1), True, 200, _rt("a", "b")),  # unknown keys ignored
    (SR, _sr("<think>a</think>b", "qwen3", return_blocks=True), True, 200,
     {**_rt("a", "b"), "reasoning_blocks": ["a"], "text_blocks": ["b"],
      "blocks": [{"type": "reasoning", "text": "a"}, {"type": "text", "text": "b"}]}),
    (SR, _sr("b", "qwen3", return_blocks="yes"), True, 200,
     {**_rt("", "b"), "reasoning_blocks": [], "text_blocks": ["b"], "blocks": [{"type": "text", "text": "b"}]}),
    (SR, _sr("b", "qwen3", return_blocks=1), True, 200,
     {**_rt("", "b"), "reasoning_blocks": [], "text_blocks": ["b"], "blocks": [{"type": "text", "text": "b"}]}),
    # errors
    (SR, _sr("<think>a</think>b", "kimi_k2"), False, 401, {"error": "Unauthorized"}),
    (SR, _sr("a", "bogus"), True, 500, ISE),
    (SR, _sr("a", ""), True, 500, ISE),
    (SR, _sr("a", "deepseek-v4"), True, 400, _adapter("deepseek-v4")),
    (SR, {"text": "a"}, True, 400, Invalid("'reasoning_parser'), 'msg': 'Field required'")),
    (SR, {"reasoning_parser": "qwen3"}, True, 400, Invalid("'text'), 'msg': 'Field required'")),
    (SR, _sr(5, "qwen3"), True, 400, Invalid("'text'), 'msg': 'Input should be a valid string'")),
    (SR, {"text": None, "reasoning_parser": "qwen3"}, True, 400, Invalid("'string_type'", "'text')")),
    (SR, _sr("a", "qwen3", return_blocks=2), True, 400, Invalid("'bool_parsing'", "'return_blocks')")),
    (SR, _sr("a", "qwen3", rid=5), True, 400, Invalid("'rid'), 'msg': 'Input should be a valid string'")),
    (SR, [1, 2], True, 400, Invalid("'msg': 'Input should be a valid dictionary'")),
    (SR, b"", True, 400, Invalid("{'type': 'missing', 'loc': ('body',), 'msg': 'Field required'")),
    (SR, b"{nope", True, 400, Invalid("'json_invalid'")),
    # kimi_k2: names from the call ids (any name), raw argument text, tool_index counts this text's calls
    (PF, _pf("Checking." + KIMI_CALL, "kimi_k2"), True, 200, _calls("Checking.", (0, "get_weather", '{"city": "Paris"}'))),
    (PF, _pf("a" + _kimi_calls(("functions.get_time:3", '{"zone":"UTC"}'), ("functions.nope:4", "{not json}")),
             "kimi_k2"), True, 200, _calls("a", (0, "get_time", '{"zone":"UTC"}'), (1, "nope", "{not json}"))),
    (PF, _pf(_kimi_calls(("7", '{"city": "Oslo"}')), "kimi_k2", ONE_TOOL), True, 200,
     _calls("", (0, "get_weather", '{"city": "Oslo"}'))),
    (PF, _pf(_kimi_calls(("7", '{"zone": "CET"}')), "kimi_k2"), True, 200, _calls("", (0, "get_time", '{"zone": "CET"}'))),
    (PF, _pf("x" + _kimi_calls(("7", "{bad}")), "kimi_k2"), True, 200, _calls("x")),
    (PF, _pf("x" + _kimi_calls(("get_weather", "{}")), "kimi_k2"), True, 200, _calls("x")),
    (PF, _pf("Checking." + KIMI_CALL, "kimi_k2", []), True, 200, _calls("Checking." + KIMI_CALL)),
    (PF, {"text": "Checking." + KIMI_CALL, "tool_call_parser": "kimi_k2"}, True, 200, _calls("Checking." + KIMI_CALL)),
    (PF, _pf("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|>", "kimi_k2"),
     True, 200, _calls("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|>")),
    (PF, _pf(" a \n" + _qwen_call({"name": "get_time", "arguments": {"zone": "Köln"}}) + "\ntail", "qwen25"), True,
     200, _calls("a", (1, "get_time", '{"zone": "Köln"}'))),
    # qwen25: arguments re-serialised, tool_index is the tool's place in tools, unknown functions dropped
    (PF, _pf(_qwen_call({"name": "nope", "arguments": {}}), "qwen25"), True, 200, _calls("")),
    (PF, _pf("x" + _qwen_call({"name": "get_weather", "arguments": '{"city": "Rome"}'}), "qwen"), True, 200,
     _calls("x", (0, "get_weather", '"{\\"city\\": \\"Rome\\"}"'))),
    (PF, _pf(_qwen_call([{"name": "get_time", "parameters": {"zone": 1}}, {"name": "get_weather"}]), "qwen25"),
     True, 200, _calls("", (1, "get_time", '{"zone": 1}'), (0, "get_weather", "{}"))),
    (PF, _pf("x<tool_call>\n{broken\n</tool_call>", "qwen25"), True, 200, _calls("x")),
    (PF, _pf("x<tool_call>{}</tool_call>", "qwen25"), True, 200, _calls("x<tool_call>{}</tool_call>")),
    (PF, _pf(_qwen_call({"name": {}}), "qwen25"), True, 200, _calls("")),
    (PF, _pf(_qwen_call([1]), "qwen25"), True, 500, ISE),
    # errors
    (PF, _pf("x", "kimi_k2"), False, 401, {"error": "Unauthorized"}),
    (PF, _pf("x", "bogus", []), True, 500, ISE),
    (PF, _pf("x", "Kimi_K2"), True, 500, ISE),  # not lower-cased
    (PF, _pf("x", None), True, 500, ISE),
    (PF, {"text": "x", "tools": TOOLS}, True, 500, ISE),
    (PF, _pf("x", "deepseekv4"), True, 400, _adapter("deepseekv4")),
    (PF, {"tool_call_parser": "kimi_k2"}, True, 400, Invalid("'text'), 'msg': 'Field required'")),
    (PF, _pf("x", "qwen25", None), True, 400, Invalid("'tools'), 'msg': 'Input should be a valid list'")),
    (PF, _pf("x", "qwen25", {"a": 1}), True, 400, Invalid("'list_type'")),
    (PF, _pf("x", "qwen25", [{"type": "function"}]), True, 400, Invalid("'function'), 'msg': 'Field required'")),
    (PF, _pf("x", "qwen25", [{"function": {"name": 5}}]), True, 400, Invalid("'name'), 'msg': 'Input should be a valid string'")),
    (PF, _pf("x", "qwen25", [{"function": {"name": "f", "parameters": []}}]), True, 400,
     Invalid("'parameters'), 'msg': 'Input should be a valid dictionary'")),
    (PF, _pf("x", "qwen25", [{"function": {"name": "f"}, "type": 3}]), True, 400,
     Invalid("'type'), 'msg': 'Input should be a valid string'")),
    (PF, _pf("x", "qwen25", [[1]]), True, 400, Invalid("'msg': 'Input should be a valid dictionary'")),
]  # fmt: skip


def _check_parser_answer(status: int, content_type: str, body: bytes, want_status: int, want: Any) -> None:
    assert status == want_status, body
    if want == ISE:
        assert content_type.startswith("text/plain") and body.decode() == ISE
        return
    assert content_type == "application/json"
    got = json.loads(body)
    if isinstance(want, Invalid):
        assert set(got) == {"object", "message", "type", "param", "code"}
        assert (got["object"], got["type"], got["param"], got["code"]) == ("error", "Bad Request", None, 400)
        assert got["message"].split(":")[0].endswith(("validation error", "validation errors"))
        for fragment in want.fragments:
            assert fragment in got["message"], got["message"]
        return
    assert got == want


@pytest.fixture(scope="module")
def parser_server() -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer(FakeConfig(api_key=KEY)) as srv:
        yield srv


def _parser_post(url: str, path: str, body: Any, auth: bool) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"} if auth else {}
    if isinstance(body, bytes):
        return _HTTP.post(url + path, content=body, headers={**headers, "content-type": "application/json"})
    return _HTTP.post(url + path, json=body, headers=headers)


@pytest.mark.parametrize(("path", "body", "auth", "status", "want"), PARSER_CASES)
def test_parser_endpoints(
    parser_server: FakeSGLangServer, path: str, body: Any, auth: bool, status: int, want: Any
) -> None:
    r = _parser_post(parser_server.url, path, body, auth)
    _check_parser_answer(r.status_code, r.headers["content-type"], r.content, status, want)


def test_parser_endpoints_count_calls_and_refuse_what_the_fake_cannot_parse() -> None:
    with FakeSGLangServer(FakeConfig()) as srv:
        assert _HTTP.get(srv.url + SR).status_code == 405
        for name in ("gpt-oss", "kimi_k3"):  # real SGLang parses these; the fake says it cannot
            r = _HTTP.post(srv.url + SR, json=_sr("a", name))
            assert r.status_code == 400 and f"does not implement the reasoning parser '{name}'" in r.json()["message"]
        r = _HTTP.post(srv.url + PF, json=_pf("a", "hermes"))
        assert r.status_code == 400 and "does not implement the tool-call parser 'hermes'" in r.json()["message"]
        assert "kimi_k2, qwen, qwen25" in r.json()["message"]
        assert srv.stats()["parser_calls"] == {SR: 2, PF: 1}  # the 405 never reached the route


def test_parse_reply_against_the_fake_and_while_it_is_down() -> None:
    """server/parsers.py's client on the fake: the assistant message for the next turn's history."""
    import asyncio

    from eagle_datagen.errors import ServerError
    from eagle_datagen.server.parsers import ParsedReply, parse_reply

    def parse(url: str, text: str, reasoning: str | None, tool: str | None, **kw: Any) -> ParsedReply:
        async def go() -> ParsedReply:
            async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {KEY}"}) as http:
                return await parse_reply(
                    http, url, text, reasoning_parser=reasoning, tool_call_parser=tool, tools=TOOLS,
                    call_id=lambda i: f"row7@t2:{i}", **kw,
                )  # fmt: skip

        return asyncio.run(go())

    with FakeSGLangServer(FakeConfig(api_key=KEY)) as srv:
        kimi = parse(srv.url, f"<think>look it up</think>Checking.{KIMI_CALL}", "kimi_k2", "kimi_k2", earlier_calls=2)
        assert kimi.message() == {
            "role": "assistant", "content": "Checking.", "reasoning_content": "look it up",
            "tool_calls": [{"id": "functions.get_weather:2", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        }  # fmt: skip
        qwen = parse(srv.url, "<think>hm</think>\n\nSure." + _qwen_call({"name": "get_time", "arguments": {}}),
                     "qwen3", "qwen25")  # fmt: skip
        assert qwen.message() == {
            "role": "assistant", "content": "Sure.", "reasoning_content": "hm",
            "tool_calls": [{"id": "row7@t2:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        }  # fmt: skip
        assert parse(srv.url, "plain", None, None).message() == {"role": "assistant", "content": "plain"}
        with pytest.raises(ServerError, match=r"/separate_reasoning answered 500: Internal Server Error; check"):
            parse(srv.url, "x", "bogus", None)
        assert srv.stats()["parser_calls"] == {SR: 3, PF: 2}
        srv.go_down()
        with pytest.raises(ServerError, match="could not be reached"):
            parse(srv.url, "x", "qwen3", None)
        srv.come_up()
        assert parse(srv.url, "<think>a</think>b", "qwen3", None).content == "b"


_REAL_PARSERS_SCRIPT = """
import json, sys
from types import SimpleNamespace
import sglang.srt.entrypoints.http_server as hs
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.parser.reasoning_parser import ReasoningParser
from sglang.srt.utils.auth import add_api_key_middleware
from starlette.testclient import TestClient

# SGLang's own FastAPI app, no engine: the parser routes need only these two pieces of state
hs.app.state.openai_serving_chat = SimpleNamespace(chat_encoding_spec=None, encoding_adapter=None)
hs.set_global_state(SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=None)))
req = json.load(sys.stdin)
add_api_key_middleware(hs.app, api_key=req["key"], admin_api_key=None)
client = TestClient(hs.app, raise_server_exceptions=False)
out = []
for path, body, raw, auth in req["cases"]:
    headers = {"Authorization": "Bearer " + req["key"]} if auth else {}
    if raw:
        r = client.post(path, content=body.encode(), headers={**headers, "content-type": "application/json"})
    else:
        r = client.post(path, json=body, headers=headers)
    out.append([r.status_code, r.headers.get("content-type"), r.content.decode()])
names = {"reasoning": sorted(ReasoningParser.DetectorMap), "tool_call": sorted(FunctionCallParser.ToolCallParserEnum)}
print(json.dumps({"answers": out, "names": names}))
"""


@pytest.mark.sglang
def test_parser_table_is_what_real_sglang_answers(sglang_venv_python: Path) -> None:
    """The same requests through SGLang 0.5.23's own app (its routes, validation, parsers and error handlers,
    in-process with Starlette's TestClient: no server, no model): every answer of the table holds there too."""
    from eagle_datagen.testing import fake_parsers
    from real_sglang import run_venv_python

    cases = [
        [path, body.decode() if isinstance(body, bytes) else body, isinstance(body, bytes), auth]
        for path, body, auth, _, _ in PARSER_CASES
    ]
    result = json.loads(run_venv_python(["-c", _REAL_PARSERS_SCRIPT], stdin=json.dumps({"key": KEY, "cases": cases})))
    for (status, content_type, body), case in zip(result["answers"], PARSER_CASES, strict=True):
        try:
            _check_parser_answer(status, content_type, body.encode(), case[3], case[4])
        except AssertionError as exc:
            raise AssertionError(f"real SGLang differs on {case[:3]}: {status} {body[:600]}") from exc
    assert set(result["names"]["reasoning"]) == fake_parsers.SGLANG_REASONING_PARSERS
    assert set(result["names"]["tool_call"]) == fake_parsers.SGLANG_TOOL_CALL_PARSERS


def test_going_down_while_connections_arrive_leaks_no_socket() -> None:
    """A go-down in the loop turn after an accept (the transport not made yet) once left that accepted socket to
    be collected unclosed (asyncio's ``Server._attach`` assertion, swallowed): the crash and restart tests' leak.
    Clients connect all the time while the fake goes down and up; nothing may be collected unclosed."""
    import gc

    leaks: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: leaks.append(f"{u.exc_type.__name__}: {u.exc_value}")
    try:
        with FakeSGLangServer(FakeConfig()) as srv:
            done = threading.Event()

            def connect() -> None:
                while not done.is_set():
                    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", srv.port), 1) as s:
                        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                        s.recv(100)

            clients = [threading.Thread(target=connect) for _ in range(4)]
            for t in clients:
                t.start()
            for _ in range(150):
                time.sleep(0.003)
                srv.go_down()
                time.sleep(0.002)
                srv.come_up()
            done.set()
            for t in clients:
                t.join()
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert leaks == []
