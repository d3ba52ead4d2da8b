"""Pytest plugin: a real SGLang server on CPU (from .venv-sglang), tiny models and transformers references.

Register with `pytest_plugins = ["real_sglang"]` (tests/ on sys.path). Create the venv with
scripts/setup-sglang-cpu.sh. Without it the fixtures skip, or fail when the CI env var is set.

Session fixtures for tool-call / multi-turn tests (a scripted float32 model whose reply to a prompt ending in
`<think>` is reasoning, `</think>`, an answer and one `get_weather` call, then `<|im_end|>`; every turn the same):
- `tool_kimi_model`, `tool_chatml_model`: the model directories, built by
  `tiny.build_tiny_model(out, template=..., weights="scripted", script="tool_call")`. The reply text, the tool
  to pass (`tools`) and SGLang's parser names are in `eagle_datagen.testing.tiny.tool_script(template)`:
  kimi -> Kimi-K2 markup, parsers `kimi_k2`/`kimi_k2`; chatml -> Qwen's `<tool_call>` JSON, `qwen3`/`qwen25`.
- `tool_kimi_server`, `tool_chatml_server`: a real SGLang server on each (no --reasoning-parser, float32).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIMS_DIR = ROOT / "tests" / "sglang_shims"
SGLANG_PYTHON = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang")) / "bin" / "python"
MAKE_TINY_MODEL = ROOT / "scripts" / "make_tiny_model.py"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0

_HF_GREEDY_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

req = json.load(sys.stdin)
model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
eos = model.generation_config.eos_token_id
eos = set(eos if isinstance(eos, list) else [eos])
out = []
for ids in req["prompts"]:
    x = torch.tensor([ids])
    with torch.no_grad():
        g = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=req["max_new_tokens"], do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=min(eos),
        )
    new = g[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    out.append(new if stop is None else new[: stop + 1])
print(json.dumps(out))
"""


@dataclass(frozen=True)
class SGLangServer:
    """A running server: base `url` (http://127.0.0.1:PORT), `port`, `log_path`, `process`."""

    url: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]


def venv_env(**extra: str) -> dict[str, str]:
    """Environment for .venv-sglang processes: CPU engine, offline, test shims on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(SHIMS_DIR), **extra)
    return env


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file (empty if missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _server_cmd(model_dir: Path, port: int, extra_args: Sequence[str]) -> list[str]:
    """Command line of `sglang.launch_server` for a tiny model on CPU.

    `--sleep-on-idle`: the idle scheduler otherwise spins a whole core (zmq poll wakes it on a request).
    """
    return [
        str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        "--max-total-tokens", "8192", "--dtype", "float32", "--sleep-on-idle", *extra_args,
    ]  # fmt: skip


def _wait_ready(server: SGLangServer, timeout_s: float) -> None:
    """Poll GET /health_generate until 200; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"SGLang server exited with {server.process.returncode} before it was ready; "
                f"log {server.log_path}:\n{log_tail(server.log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health_generate", timeout=10).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(
        f"SGLang server not ready after {timeout_s:.0f} s; log {server.log_path}:\n{log_tail(server.log_path)}"
    )


def _stop(process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def start_sglang_server(
    model_dir: Path, *, log_path: Path, extra_args: Sequence[str] = (), ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[SGLangServer]:
    """Run a real SGLang server on `model_dir` (own process group, private TMPDIR); stop it on exit."""
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="sglang-"))
    env = venv_env(TMPDIR=str(scratch), XDG_CACHE_HOME=str(scratch / "cache"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            _server_cmd(Path(model_dir), port, extra_args), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, env=env, cwd=scratch, start_new_session=True,
        )  # fmt: skip
    server = SGLangServer(url=f"http://127.0.0.1:{port}", port=port, log_path=log_path, process=process)
    try:
        _wait_ready(server, ready_timeout_s)
        yield server
    finally:
        _stop(process)
        shutil.rmtree(scratch, ignore_errors=True)


def run_venv_python(args: Sequence[str], *, stdin: str | None = None, timeout_s: float = 300) -> str:
    """Run .venv-sglang's python with `args`; return stdout, raise with stderr on failure."""
    proc = subprocess.run(
        [str(SGLANG_PYTHON), *args], input=stdin, capture_output=True, text=True, env=venv_env(),
        timeout=timeout_s, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{SGLANG_PYTHON} {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def build_model_in_venv(out_dir: Path, *cli_args: str) -> Path:
    """Build a tiny model with scripts/make_tiny_model.py (needs torch, so in .venv-sglang)."""
    run_venv_python([str(MAKE_TINY_MODEL), str(out_dir), *cli_args])
    return out_dir


_BUILD_TINY_MODEL = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from eagle_datagen.testing.tiny import build_tiny_model
print(build_tiny_model(Path(sys.argv[2]), **json.loads(sys.argv[3])))
"""


def build_tiny_model_in_venv(out_dir: Path, **kwargs: str | bool | int) -> Path:
    """`tiny.build_tiny_model(out_dir, **kwargs)` run in .venv-sglang (it needs torch), from this checkout's src/."""
    run_venv_python(["-c", _BUILD_TINY_MODEL, str(ROOT / "src"), str(out_dir), json.dumps(kwargs)])
    return out_dir


def hf_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' float32 greedy `generate()` ids per prompt (one at a time), ending at the first EOS."""
    request = {"model_dir": str(model_dir), "prompts": [list(p) for p in prompts], "max_new_tokens": max_new_tokens}
    out = run_venv_python(["-c", _HF_GREEDY_SCRIPT], stdin=json.dumps(request))
    result: list[list[int]] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="session")
def sglang_venv_python() -> Path:
    """Path of .venv-sglang's python; skip (fail in CI) when it is missing."""
    if SGLANG_PYTHON.exists():
        return SGLANG_PYTHON
    reason = f"{SGLANG_PYTHON} missing: run scripts/setup-sglang-cpu.sh"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_kimi_model(sglang_venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model (kimi template, random float32 weights), built once per session."""
    out = tmp_path_factory.mktemp("tiny-kimi") / "model"
    return build_model_in_venv(out, "--template", "kimi", "--weights", "random", "--dtype", "float32")


@pytest.fixture(scope="session")
def sglang_server(tiny_kimi_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A real SGLang server on `tiny_kimi_model`, once per session."""
    log_path = tmp_path_factory.mktemp("sglang-logs") / "server.log"
    with start_sglang_server(tiny_kimi_model, log_path=log_path) as server:
        yield server


@pytest.fixture(scope="session")
def tool_kimi_model(sglang_venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scripted tool-call model (kimi template, float32): it replies `tiny.tool_script("kimi").reply`."""
    out = tmp_path_factory.mktemp("tool-kimi") / "model"
    return build_tiny_model_in_venv(out, template="kimi", weights="scripted", script="tool_call")


@pytest.fixture(scope="session")
def tool_chatml_model(sglang_venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scripted tool-call model (Qwen-style chatml template, float32): it replies `tool_script("chatml").reply`."""
    out = tmp_path_factory.mktemp("tool-chatml") / "model"
    return build_tiny_model_in_venv(out, template="chatml", weights="scripted", script="tool_call")


@pytest.fixture(scope="session")
def tool_kimi_server(tool_kimi_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A real SGLang server on `tool_kimi_model`, once per session."""
    log_path = tmp_path_factory.mktemp("sglang-logs") / "tool-kimi.log"
    with start_sglang_server(tool_kimi_model, log_path=log_path) as server:
        yield server


@pytest.fixture(scope="session")
def tool_chatml_server(tool_chatml_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A real SGLang server on `tool_chatml_model`, once per session."""
    log_path = tmp_path_factory.mktemp("sglang-logs") / "tool-chatml.log"
    with start_sglang_server(tool_chatml_model, log_path=log_path) as server:
        yield server
