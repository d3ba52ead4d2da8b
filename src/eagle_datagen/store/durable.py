"""Small durable-file helpers: atomic replace and fsync of directories."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from eagle_datagen.errors import OutputWriteError


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces ``path`` with ``data``: temp file in the same directory, fsync, ``os.replace``.

    The old file stays untouched unless the new one was written completely.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise write_error(path, exc) from exc


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(path: Path, exc: OSError) -> OutputWriteError:
    """A fatal write error that says what to do."""
    reason = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return OutputWriteError(
        f"cannot write {path}: {reason}. Everything written before the last checkpoint is safe; "
        "free space or fix the problem, then continue with `eagle-datagen resume`"
    )
