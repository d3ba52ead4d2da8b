"""One object owns a managed SGLang server's life.

:class:`ManagedServer` starts ``PYTHON -m sglang.launch_server ...`` (an argument list, never a shell
string) in its own process group with stdout and stderr going to ``DIR/server.log`` through a *log masker*
(``server/logmask.py``, a process of its own that replaces every secret we gave the server, the API key
among them, with ``***``: SGLang prints its resolved server args, keys included), polls
``/health_generate`` while checking that the process is still alive, restarts a crashed server on
the same port (bounded attempts, backoff), and stops it: SIGTERM to the group, a wait, SIGKILL.

Every exit path ends in that stop:

- normal end, errors, exceptions in our code, Ctrl-C and SIGTERM (the app turns both into a clean
  stop): the caller's ``finally`` / ``with`` calls :meth:`ManagedServer.stop`;
- paths no ``finally`` sees (our process killed by SIGKILL, or by a signal that arrives before or
  after the app's handlers are installed): a *reaper*, a tiny process in its own session that holds
  one end of a pipe. When the pipe closes without the "stopped cleanly" byte, it sends the group
  SIGTERM, waits, then SIGKILL. The masker lives on too (its own session), so the server does not die of
  SIGPIPE meanwhile and its last lines still reach the log; it ends when the whole group is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import httpx

from eagle_datagen.config import LaunchConfig
from eagle_datagen.errors import ServerError, UsageError
from eagle_datagen.generate.client import is_healthy
from eagle_datagen.generate.pool import backoff_s
from eagle_datagen.redaction import environment_secrets, mask_forms, secret_values
from eagle_datagen.redaction import redact as redact  # re-exported: the launch command is shown redacted
from eagle_datagen.server import logmask

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
#: How long SGLang may take to drain and exit after SIGTERM before the group gets SIGKILL.
STOP_WAIT_S = 20.0
#: How long the group's last processes may take to die after SIGKILL.
KILL_WAIT_S = 5.0
READY_POLL_S = 0.5
#: A partial line of the server's output (a progress bar) reaches the log after this long without output.
MASK_IDLE_S = 0.2
READY_NOTE_EVERY_S = 60.0
#: A server that stayed up this long gets a fresh restart budget when it crashes.
STABLE_UPTIME_S = 600.0
#: Flags this launcher sets itself (from its own options); SGLang would take the last occurrence.
OWN_FLAGS = {
    "--model-path": "--model",
    "--model": "--model",
    "--port": "--port",
    "--host": "--host",
    "--api-key": "--api-key (or EAGLE_DATAGEN_API_KEY)",
    "--tp-size": "--tp-size",
    "--tp": "--tp-size",
    "--tensor-parallel-size": "--tp-size",
    "--mem-fraction-static": "--mem-fraction-static",
    "--trust-remote-code": "--trust-remote-code",
    "--dp-size": "--dp-size",
    "--dp": "--dp-size",
    "--data-parallel-size": "--dp-size",
}
REASONING_PARSER = "--reasoning-parser"
PREFERRED_SAMPLING = "--preferred-sampling-params"
#: The shortest prefix argparse takes for it ("--pref" is also "--prefill-...").
PREFERRED_SAMPLING_MIN_PREFIX = len("--prefe")

#: Run as ``python -I -c REAPER_CODE READ_FD PGID WAIT_S``, in its own session.
REAPER_CODE = """\
# eagle-datagen reaper: stops an SGLang process group whose owner died without stopping it.
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
fd, pgid, wait_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
if os.read(fd, 1):
    sys.exit(0)
def alive():
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    for name in names:
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
print("eagle-datagen reaper: the owner is gone; SIGTERM to process group %d" % pgid, flush=True)
try:
    os.killpg(pgid, signal.SIGTERM)
except ProcessLookupError:
    sys.exit(0)
deadline = time.monotonic() + wait_s
while alive() and time.monotonic() < deadline:
    time.sleep(0.2)
if alive():
    print("eagle-datagen reaper: SIGKILL to process group %d" % pgid, flush=True)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind-probe)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """False when something listens on ``host:port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_server_args(args: tuple[str, ...], *, allow_reasoning_parser: bool) -> None:
    """Refuses ``--reasoning-parser``, ``--preferred-sampling-params``, flags this launcher sets itself, and
    ``"--flag value"`` in one argument."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        if any(c.isspace() for c in name):
            raise UsageError(
                f"--server-arg {arg!r} holds a flag and its value in one argument (no shell splits it); write "
                f"--server-arg={name.split()[0]}=VALUE, or repeat --server-arg for the value"
            )
        # argparse (SGLang's parser) accepts unambiguous prefixes, so "--reasoning" is the parser too.
        if len(name) > 4 and REASONING_PARSER.startswith(name) and not allow_reasoning_parser:
            raise UsageError(
                "--server-arg --reasoning-parser is refused: the parser rewrites outputs for the OpenAI endpoints, "
                "and the <think> belongs to the prompt; this pipeline needs raw ids. Pass --allow-reasoning-parser "
                "to launch with it anyway"
            )
        if len(name) >= PREFERRED_SAMPLING_MIN_PREFIX and PREFERRED_SAMPLING.startswith(name):
            raise UsageError(
                f"--server-arg {PREFERRED_SAMPLING} is refused: SGLang merges it into every request for the keys "
                "the request leaves out, so outputs would follow settings the manifest does not record (and stop, "
                "ignore_eos or a grammar there would cut or bend them). Give sampling settings to eagle-datagen "
                "instead: --temperature, --top-p, --top-k, --min-p, --sampling-params JSON"
            )
        own = OWN_FLAGS.get(name) or next(
            (o for f, o in OWN_FLAGS.items() if len(name) > 3 and f.startswith(name)), None
        )
        if own is not None:
            raise UsageError(f"--server-arg {name} is set by eagle-datagen itself; use its own option {own} instead")


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
    if config.dp_size > 1:
        command += ["--dp-size", str(config.dp_size)]
    if config.trust_remote_code:
        command.append("--trust-remote-code")
    if api_key:
        command += ["--api-key", api_key]
    return command + list(config.server_args)


def describe_exit(code: int | None) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a negative Popen return code."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory?)" if code == -signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


class ManagedServer:
    """An SGLang server process that we start, watch, restart and always stop."""

    #: What the process is, in messages; the path polled for readiness (subclasses change both).
    what = "SGLang server"
    ready_path = "/health_generate"

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
        #: Restarts over the server's life, and attempts since it last stayed up for a while.
        self.restarts = 0
        self.attempts = 0
        self.started_at = 0.0
        self.ready_at: float | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._reaper_fd: int | None = None
        self._masker: subprocess.Popen[bytes] | None = None
        if config.host not in {"127.0.0.1", "localhost", "::1"} and not api_key:
            log.warning(
                "the SGLang server will listen on %s without an API key: anyone who can reach this machine can use "
                "it; pass --api-key (or EAGLE_DATAGEN_API_KEY)",
                config.host,
            )

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.config.host, self.config.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return launch_command(self.config, self.port, self.api_key)

    @property
    def pgid(self) -> int | None:
        """The process group of the running server (its leader's pid)."""
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Starts the log masker and the process group (output appended to the log), and arms the reaper."""
        if self.process is not None:
            self.stop()
        if not port_is_free(self.config.host, self.port):
            raise ServerError(
                f"port {self.port} on {self.config.host} is already in use (another SGLang server?); stop it, give "
                "a free --port, or leave --port out to get one"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        # Private: the masker hides the secrets we know of; the log is still nobody else's business.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if self.api_key:
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "ab") as log_file:
            log_file.write(f"\n=== eagle-datagen: starting {' '.join(redact(self.command))}\n".encode())
            log_file.flush()
            output = self._start_masker(log_file, secret_values(self.command) + environment_secrets(env))
            try:
                self.process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
            except OSError as exc:
                raise ServerError(
                    f"cannot start {self.config.server_python!r} ({exc.strerror}); point --server-python at the "
                    "Python of the environment where SGLang is installed"
                ) from exc
            finally:
                if isinstance(output, int):
                    os.close(output)  # the server's group holds the only write ends now: EOF when it is gone
                if self.process is None:
                    self._close_masker()
            self._arm_reaper(self.process.pid, log_file)
        self._note(f"process group {self.process.pid}")
        self.started_at = time.monotonic()
        self.ready_at = None

    def _start_masker(self, log_file: BinaryIO, secrets: list[str]) -> int | BinaryIO:
        """Starts the log masker (``python -I logmask.py FD IDLE_S LOG``) writing to ``log_file``; returns the
        write end of the pipe it reads, for the server's stdout and stderr.

        The secrets travel on a second pipe, inherited as ``FD``, never in an argument list (``ps``)."""
        if not sys.executable:
            if secrets:
                raise ServerError(
                    "no Python executable is known (sys.executable is empty) to run the log masker, and without it "
                    "the secrets given to the server (--api-key, secret --server-arg values) would reach its log"
                )
            log.warning("no Python executable known: the server's output goes to its log unmasked")
            return log_file
        secrets_read, secrets_write = os.pipe()
        output_read, output_write = os.pipe()
        try:
            self._masker = subprocess.Popen(
                [sys.executable, "-I", logmask.__file__, str(secrets_read), str(MASK_IDLE_S), str(self.log_path)],
                stdin=output_read,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(secrets_read,),
                start_new_session=True,  # outlives us (kill -9) like the server and the reaper
            )
        except OSError as exc:
            os.close(secrets_write)
            os.close(output_write)
            raise ServerError(f"cannot start the log masker with {sys.executable!r} ({exc.strerror})") from exc
        finally:
            os.close(secrets_read)
            os.close(output_read)
        try:
            with os.fdopen(secrets_write, "wb") as channel:
                channel.write(b"\0".join(mask_forms(secrets)))
        except OSError as exc:
            os.close(output_write)
            self._close_masker()
            raise ServerError(f"the log masker exited at once ({exc}); see {self.log_path}") from exc
        return output_write

    def _close_masker(self) -> None:
        """Waits for the masker to copy the server's last lines: it ends when every writer of its pipe (the
        whole server group) is gone. A process that left the group and still holds the pipe gets it ended."""
        masker, self._masker = self._masker, None
        if masker is None:
            return
        try:
            masker.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self._note(f"the server's output pipe is still open after {KILL_WAIT_S:g} s: stopping the log masker")
            masker.terminate()  # it writes what it holds, masked, and exits
            try:
                masker.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                masker.kill()
                masker.wait()

    def _arm_reaper(self, pgid: int, log_file: BinaryIO) -> None:
        """Starts the reaper that stops ``pgid`` if this process dies without calling :meth:`stop`."""
        if not sys.executable:
            log.warning("no Python executable known: the SGLang server is not guarded against our own sudden death")
            return
        read_fd, write_fd = os.pipe()
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-c", REAPER_CODE, str(read_fd), str(pgid), str(STOP_WAIT_S)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(read_fd,),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(write_fd)
            log.warning("could not start the reaper (%s): the server is not guarded against our sudden death", exc)
            return
        finally:
            os.close(read_fd)
        self._reaper_fd = write_fd

    def _disarm_reaper(self) -> None:
        fd, self._reaper_fd = self._reaper_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, b"x")
            os.close(fd)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        """Polls :attr:`ready_path` until the start-up timeout, failing at once if the process exits."""
        deadline = self.started_at + self.config.startup_timeout_s
        next_note = self.started_at + READY_NOTE_EVERY_S
        while True:
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise ServerError(
                    f"the {self.what} exited during start-up ({describe_exit(code)}). "
                    f"Last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self.log_tail()}{self._hint()}"
                )
            remaining = deadline - time.monotonic()
            healthy = await is_healthy(http, self.url, timeout_s=max(1.0, min(10.0, remaining)), path=self.ready_path)
            # Checked again: a 200 must come from our process, not from a stranger on the same port.
            if healthy and self.alive():
                return
            now = time.monotonic()
            if now > deadline:
                raise ServerError(
                    f"the {self.what} was not ready after {self.config.startup_timeout_s:.0f} s "
                    f"(--startup-timeout-s). Last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self.log_tail()}"
                )
            if now >= next_note:
                log.info("waiting for SGLang to load (%.0f s so far; log: %s)", now - self.started_at, self.log_path)
                next_note += READY_NOTE_EVERY_S
            await asyncio.sleep(READY_POLL_S)

    def _hint(self) -> str:
        tail = self.log_tail()
        if "No module named sglang" in tail or "No module named 'sglang'" in tail:
            return (
                f"\nSGLang is not installed for {self.config.server_python}: point --server-python at the Python "
                "of the environment where it is"
            )
        return ""

    async def start(self, http: httpx.AsyncClient) -> None:
        """Spawns the server and waits until it is ready; stops it on any failure (or Ctrl-C)."""
        try:
            self.spawn()
            await self.wait_ready(http)
        except BaseException:
            self.stop()
            raise
        self.ready_at = time.monotonic()

    async def restart(self, http: httpx.AsyncClient, *, charged: bool = True) -> bool:
        """Stops whatever is left and starts again on the same port, with backoff.

        Each restart within :data:`STABLE_UPTIME_S` of the last start uses one of ``--max-restarts``;
        ``charged=False`` when the crash is explained (a request that crashed the server while it ran
        alone was set aside), so a poison prompt does not use up the budget. Start failures always count.
        """
        if self.ready_at is not None and time.monotonic() - self.ready_at >= STABLE_UPTIME_S:
            self.attempts = 0
        code = self.process.poll() if self.process is not None else None
        why = "was unresponsive" if code is None else f"crashed ({describe_exit(code)})"
        crash = why
        start_failures = 0
        while True:
            counted = charged or start_failures > 0
            if counted:
                if self.attempts >= self.config.max_restarts:
                    raise ServerError(self._gave_up(crash, start_failures))
                self.attempts += 1
            self.restarts += 1
            self.stop()
            budget = f"{self.attempts} of {self.config.max_restarts}" if counted else "not counted: explained"
            self._note(f"restart {budget}: the server {why}")
            log.warning("the SGLang server %s; restarting it (restart %s; log: %s)", why, budget, self.log_path)
            await asyncio.sleep(backoff_s(max(1, self.attempts), base_s=2.0, cap_s=60.0))
            try:
                await self.start(http)
                return True
            except ServerError as exc:
                log.error("restart failed: %s", exc)
                why = "failed to start again"
                start_failures += 1

    def _gave_up(self, crash: str, start_failures: int) -> str:
        fix = f"see {self.log_path}. Fix the cause, then continue with `eagle-datagen resume`"
        if start_failures:
            return (
                f"the SGLang server {crash}, then failed to start {start_failures} time(s) in a row "
                f"(--max-restarts {self.config.max_restarts}); {fix}"
            )
        return (
            f"the SGLang server {crash}: that is {self.attempts + 1} times within {STABLE_UPTIME_S:.0f} s of a "
            f"start, more than --max-restarts {self.config.max_restarts} allows. Requests in flight at "
            "consecutive crashes were sent alone and none crashed it alone, so the cause is not one prompt; "
            f"{fix}"
        )

    def stop(self) -> None:
        """SIGTERM to the process group, a wait, then SIGKILL. Safe to call twice.

        Interrupted (a second Ctrl-C), it still sends SIGKILL; if it never gets that far, the
        reaper finishes the job when this process exits.
        """
        process = self.process
        if process is None:
            return
        pgid = process.pid
        if process.poll() is None:
            self._note(f"stopping: SIGTERM to process group {pgid}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._note(f"no exit after {STOP_WAIT_S:.0f} s: SIGKILL to process group {pgid}")
        finally:
            # SGLang's children may outlive the leader; the whole group goes either way.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=KILL_WAIT_S)
        deadline = time.monotonic() + KILL_WAIT_S
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._close_masker()
        self._disarm_reaper()
        self.process = None

    def _note(self, message: str) -> None:
        """One line of ours in the server log."""
        with contextlib.suppress(OSError), self.log_path.open("ab") as handle:
            handle.write(f"=== eagle-datagen: {message}\n".encode())

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The log's last lines. A server that has exited is stopped first (the rest of its group), so that its
        last lines, still on their way through the masker, are there."""
        if self.process is not None and self.process.poll() is not None:
            self.stop()
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


def group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs (zombies, which only wait to be reaped, do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc: trust kill(0)
        return True
    for name in names:
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
