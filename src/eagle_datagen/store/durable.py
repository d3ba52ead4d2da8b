"""Small durable-file helpers: atomic replace, fsync of directories, and the sweep of stale temp files.

Every file eagle-datagen creates is created with mode ``0o666`` and the process umask applied by the kernel,
the way ``open()`` or ``touch`` would (umask 022 gives 0644): a teammate's ``verify-shard`` or a training job
running as another user reads the manifest exactly when it can read the shards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from pathlib import Path

from eagle_datagen.errors import OutputWriteError

#: Mode new files are created with; the kernel applies the umask.
FILE_MODE = 0o666
#: Temp files of :func:`write_atomic` (and of ``tempfile.mkstemp(prefix=".NAME.", suffix=".tmp")``).
TEMP_RE = re.compile(r"^\..+\.tmp$")


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces ``path`` with ``data``: temp file in the same directory, fsync, ``os.replace``.

    The old file stays untouched unless the new one was written completely. The new file gets the umask's
    default mode (like the shards), whatever the mode of the one it replaces. A crash can leave a
    ``.NAME.XXXX.tmp`` file behind; :func:`sweep_temp_files` removes those when the directory is opened again.
    """
    tmp, fd = _create_temp(path)
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


def _create_temp(path: Path) -> tuple[Path, int]:
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except FileExistsError:
            continue
        except OSError as exc:
            raise write_error(path, exc) from exc
    raise write_error(path, FileExistsError(errno.EEXIST, "no free temp file name"))  # pragma: no cover


def sweep_temp_files(directory: Path) -> list[str]:
    """Removes the ``.NAME.XXXX.tmp`` files a crash inside :func:`write_atomic` left in ``directory``.

    Only the directory's one writer may call this (it holds ``DIR/.lock``): another writer's temp file
    would be removed under it. Returns the names removed.
    """
    removed = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if TEMP_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return sorted(removed)


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
        f"cannot write {path}: {reason}. Every record accepted before this is safe; "
        "free space or fix the problem, then continue with `eagle-datagen resume`"
    )
