"""Side files of a run: ``failures.jsonl`` (requests that failed) and ``rejects.jsonl`` (rows set aside)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.store.durable import FILE_MODE, write_error

FAILURES_NAME = "failures.jsonl"
REJECTS_NAME = "rejects.jsonl"
#: ``--turns all``: one line per ended conversation (its last record id, its turns, why it ended)
ENDS_NAME = "conversations.jsonl"


class JsonlLog:
    """An append-only JSONL file: each entry reaches the kernel as one whole line when appended, and is
    fsynced at checkpoints; ``truncate`` starts it afresh."""

    def __init__(self, path: Path, *, truncate: bool = False) -> None:
        self.path = path
        self.count = 0
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        try:
            self._fd: int | None = os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
            if not truncate:
                _drop_torn_tail(path)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise write_error(path, exc) from exc

    def append(self, entry: dict[str, Any]) -> None:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}
        assert self._fd is not None
        line = orjson.dumps(entry) + b"\n"
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):  # never leave half a line for the next entry to follow
                os.ftruncate(self._fd, self._size)
            raise write_error(self.path, exc) from exc
        finally:
            view.release()
        self._size += len(line)
        self.count += 1

    def checkpoint(self) -> None:
        if self._fd is not None and self.count:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise write_error(self.path, exc) from exc

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.checkpoint()
            finally:
                os.close(self._fd)
                self._fd = None


def _drop_torn_tail(path: Path) -> None:
    size = path.stat().st_size
    if not size:
        return
    with path.open("rb") as handle:
        handle.seek(max(0, size - (1 << 16)))
        tail = handle.read()
    if not tail.endswith(b"\n"):
        cut = tail.rfind(b"\n")
        os.truncate(path, size - len(tail) + cut + 1 if cut >= 0 else max(0, size - len(tail)))


def read_entries(path: Path) -> Iterator[dict[str, Any]]:
    """Entries of a JSONL side file, skipping lines that do not parse."""
    if not path.is_file():
        return
    with path.open("rb") as handle:
        for line in handle:
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(entry, dict):
                yield entry
