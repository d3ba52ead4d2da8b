"""One writer per output directory: an exclusive ``fcntl.flock`` on ``DIR/.lock``.

``run`` and ``resume`` hold :func:`hold` for their whole life; a second one on the same directory is
refused at once with ``DIR is in use by pid N (started …)``. The lock is the kernel's, so it ends with
the process however that dies (``kill -9`` included): a ``.lock`` file left behind never blocks anyone, and
its content (pid, host, start time, command, as JSON) only feeds the messages. The file stays after the
run; removing it would let a second writer lock a file the first one no longer sees.

For readers (``verify-shard``, ``export``, ``stats``): :func:`is_locked` returns the live writer as a
:class:`Holder`, or ``None`` when nobody writes there, so a reader can say "a run is still writing to
DIR: the last shard is in progress" instead of reporting a live ``.partial`` as damage::

    from eagle_datagen.store.lock import is_locked
    if (holder := is_locked(out_dir)) is not None:
        print(f"warning: {holder.describe(out_dir)}")  # DIR is in use by pid N (started …, eagle-datagen run)

A :class:`Holder` is truthy and ``str(holder)`` is its pid. :func:`is_locked` takes a shared lock for an instant (a writer starting at that moment retries for
:data:`ACQUIRE_RETRY_S`), needs only read access, and never creates the file.

The holder also owns the directory's temp files: on acquiring, stale ``.NAME.XXXX.tmp`` files that a
killed writer left in ``DIR`` are swept (``durable.sweep_temp_files``; ``ShardStore.open`` does the same
for ``DIR/shards``).

``flock`` works on local file systems and on NFSv4 (Linux maps it to a byte-range lock there); on Lustre
it needs the ``flock`` mount option, or ``run`` says it cannot lock the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from eagle_datagen.errors import UsageError
from eagle_datagen.store.durable import FILE_MODE, sweep_temp_files

LOCK_NAME = ".lock"
#: A writer that finds the lock taken retries this long: a reader's :func:`is_locked` holds it for an instant.
ACQUIRE_RETRY_S = 0.5


class DirectoryInUse(UsageError):
    """Another live process writes to the output directory."""

    def __init__(self, directory: Path, holder: Holder) -> None:
        self.holder = holder
        super().__init__(
            f"{holder.describe(directory)}. Only one run or resume may write to a directory: wait for it to end, "
            f"or stop it{holder.stop_hint()}, then continue with `eagle-datagen resume --out {directory}`"
        )


@dataclass(frozen=True)
class Holder:
    """Who holds a directory's lock, as it wrote into ``DIR/.lock`` (``pid`` is ``None`` when unreadable)."""

    pid: int | None
    host: str = ""
    started: str = ""
    command: str = ""

    def __str__(self) -> str:
        """The pid, so that ``f"in use by pid {is_locked(d)}"`` reads right."""
        return str(self.pid) if self.pid is not None else "(unknown)"

    def describe(self, directory: Path) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "another process"
        if self.host and self.host != socket.gethostname():
            who += f" on {self.host}"
        details = ", ".join(x for x in (f"started {self.started}" if self.started else "", self.command) if x)
        return f"{directory} is in use by {who}" + (f" ({details})" if details else "")

    def stop_hint(self) -> str:
        if self.pid is None or (self.host and self.host != socket.gethostname()):
            return ""
        return f" (`kill -INT {self.pid}` stops it cleanly, like Ctrl-C)"


class DirectoryLock:
    """The exclusive lock on ``DIR/.lock``; :meth:`acquire` raises :class:`DirectoryInUse` when taken."""

    def __init__(self, directory: Path, command: str) -> None:
        self.directory = directory
        self.command = command
        self.path = directory / LOCK_NAME
        self._fd: int | None = None
        self.swept: list[str] = []

    def acquire(self) -> None:
        if not self.directory.is_dir():
            raise UsageError(f"{self.directory} does not exist or is not a directory")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise UsageError(
                f"cannot lock {self.directory} ({self.path}: {exc.strerror}); it must be writable"
            ) from exc
        try:
            _flock_exclusive(fd, self.directory)
            info = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": self.command,
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, orjson.dumps(info) + b"\n", 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.swept = sweep_temp_files(self.directory)

    def release(self) -> None:
        """Unlocks; the file stays (its content is stale from now on, which :func:`is_locked` knows)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def hold(directory: Path, command: str) -> Iterator[DirectoryLock]:
    """Holds ``DIR/.lock`` for the block (``command`` names the holder in messages: ``eagle-datagen run``)."""
    lock = DirectoryLock(directory, command)
    with lock:
        yield lock


def is_locked(directory: Path) -> Holder | None:
    """The live writer of ``directory``, or ``None`` (no ``.lock``, nobody holding it, or not readable)."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        except OSError:
            return None  # a file system without flock: nobody could be holding it either
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_not_in_use(directory: Path) -> None:
    """Raises :class:`DirectoryInUse` when a live process holds ``directory``'s lock."""
    holder = is_locked(directory)
    if holder is not None:
        raise DirectoryInUse(directory, holder)


def _flock_exclusive(fd: int, directory: Path) -> None:
    deadline = time.monotonic() + ACQUIRE_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise DirectoryInUse(directory, _read_holder(fd)) from None
            time.sleep(0.02)
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise UsageError(
                    f"cannot lock {directory}: its file system does not support flock ({exc.strerror}); "
                    "write to a local disk or NFSv4 (on Lustre, mount with -o flock)"
                ) from exc
            raise UsageError(f"cannot lock {directory}: {exc.strerror}") from exc


def _read_holder(fd: int) -> Holder:
    try:
        data = orjson.loads(os.pread(fd, 4096, 0))
    except (OSError, orjson.JSONDecodeError):
        return Holder(None)
    if not isinstance(data, dict):
        return Holder(None)
    pid = data.get("pid")
    return Holder(
        pid if isinstance(pid, int) else None,
        str(data.get("host", "")),
        str(data.get("started", "")),
        str(data.get("command", "")),
    )
