"""One object owns a managed SGLang server's life.

It starts ``PYTHON -m sglang.launch_server ...`` (an argument list, never a shell string) in its
own process group with output to ``DIR/server.log``, polls readiness while checking the process is
alive, and on every exit path sends the group SIGTERM, waits, then SIGKILL. ``restart`` brings a
crashed server back on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import httpx

from eagle_datagen.client import is_healthy
from eagle_datagen.config import LaunchConfig
from eagle_datagen.errors import ServerError, UsageError
from eagle_datagen.pool import backoff_s

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
STOP_WAIT_S = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind-probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_server_args(args: tuple[str, ...], *, allow_reasoning_parser: bool) -> None:
    """Refuses a ``--reasoning-parser`` and flags that this launcher sets itself."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name == "--reasoning-parser" and not allow_reasoning_parser:
            raise UsageError(
                "--server-arg --reasoning-parser is refused: the parser rewrites outputs for the OpenAI endpoints, "
                "and the <think> belongs to the prompt; this pipeline needs raw ids. Pass --allow-reasoning-parser "
                "to launch with it anyway"
            )
        if name in {"--model-path", "--model", "--port", "--host", "--api-key"}:
            raise UsageError(f"--server-arg {name} is set by eagle-datagen itself; use its own flag instead")


def launch_command(config: LaunchConfig, port: int, api_key: str | None) -> list[str]:
    """The argument list that starts the server; :func:`redact` hides the key wherever it is shown."""
    command = [
        config.server_python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(config.model),
        "--tp-size",
        str(config.tp_size),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
        "--host",
        config.host,
        "--port",
        str(port),
    ]
    if config.trust_remote_code:
        command.append("--trust-remote-code")
    if api_key:
        command += ["--api-key", api_key]
    return command + list(config.server_args)


def redact(command: list[str]) -> list[str]:
    """The command with the API key hidden, for logs and the manifest."""
    out = list(command)
    for i, arg in enumerate(out[:-1]):
        if arg == "--api-key":
            out[i + 1] = "***"
    return out


class ManagedServer:
    """An SGLang server process that we start, watch, restart and always stop."""

    def __init__(
        self,
        config: LaunchConfig,
        log_path: Path,
        *,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        check_server_args(config.server_args, allow_reasoning_parser=config.allow_reasoning_parser)
        self.config = config
        self.log_path = log_path
        self.api_key = api_key
        self.env = env
        self.port = config.port or free_port(config.host)
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.started_at = 0.0

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in {"0.0.0.0", "::"} else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return launch_command(self.config, self.port, self.api_key)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Starts the process group; output is appended to the log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n=== eagle-datagen: starting {' '.join(redact(self.command))}\n".encode())
            log_file.flush()
            try:
                self.process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **(self.env or {})},
                )
            except OSError as exc:
                raise ServerError(
                    f"cannot start {self.config.server_python!r} ({exc.strerror}); point --server-python at the "
                    "Python of the environment where SGLang is installed"
                ) from exc
        self.started_at = time.monotonic()

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        """Polls readiness until the start-up timeout, failing at once if the process exits."""
        deadline = self.started_at + self.config.startup_timeout_s
        while True:
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise ServerError(
                    f"the SGLang server exited during start-up (exit code {code}). Last lines of {self.log_path}:\n"
                    + self.log_tail()
                )
            if await is_healthy(http, self.url, timeout_s=10.0, path="/health_generate"):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the SGLang server was not ready after {self.config.startup_timeout_s:.0f} s "
                    f"(--startup-timeout-s). Last lines of {self.log_path}:\n" + self.log_tail()
                )
            await asyncio.sleep(1.0)

    async def start(self, http: httpx.AsyncClient) -> None:
        self.spawn()
        try:
            await self.wait_ready(http)
        except BaseException:
            self.stop()
            raise

    async def restart(self, http: httpx.AsyncClient) -> bool:
        """Stops whatever is left and starts again, with bounded attempts and backoff."""
        while self.restarts < self.config.max_restarts:
            self.restarts += 1
            self.stop()
            log.warning("restarting the SGLang server (attempt %d of %d)", self.restarts, self.config.max_restarts)
            await asyncio.sleep(backoff_s(self.restarts, base_s=2.0, cap_s=60.0))
            try:
                await self.start(http)
                return True
            except ServerError as exc:
                log.error("restart failed: %s", exc)
        raise ServerError(
            f"the SGLang server crashed and {self.config.max_restarts} restarts failed; see {self.log_path}. "
            "Fix the cause, then continue with `eagle-datagen resume`"
        )

    def stop(self) -> None:
        """SIGTERM to the process group, a wait, then SIGKILL. Safe to call twice."""
        process = self.process
        if process is None:
            return
        pgid = process.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_WAIT_S)
        # SGLang's children may outlive the leader; the group goes either way.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        self.process = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with self.log_path.open("rb") as handle:
                tail = deque(handle, maxlen=lines)
        except OSError:
            return "(no log)"
        return b"".join(tail).decode("utf-8", "replace").rstrip()

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
