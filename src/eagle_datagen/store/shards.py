"""Append-only JSONL shards that survive ``kill -9``.

Layout under ``DIR/shards/``::

    shard_00000.jsonl      finalized: closed, fsynced, its count and sha256 in the manifest
    shard_00000.ids        the ids it holds, one per line (so resume never re-parses token lists)
    shard_00001.jsonl.partial   the shard being written

Records are appended as whole lines and fsynced at checkpoints; a crash can only leave a torn
last line, which :meth:`ShardStore.open` truncates away (and says so). The shards are the truth:
``.ids`` files and the manifest are rebuilt from them when they disagree.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.store.durable import fsync_dir, write_atomic, write_error

SHARD_RE = re.compile(r"^shard_(\d{5,})\.jsonl(\.partial)?$")
#: Records start with their id (orjson keeps insertion order), so resume reads just that much.
ID_PREFIX_RE = re.compile(rb'^\{"id":("(?:[^"\\]|\\.)*")')
WRITE_BUFFER_BYTES = 1 << 20


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.jsonl"


@dataclass(frozen=True)
class ShardInfo:
    """A finalized shard as the manifest records it."""

    name: str
    records: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "records": self.records, "sha256": self.sha256}


@dataclass
class OpenReport:
    """What :meth:`ShardStore.open` found and repaired."""

    finalized: list[ShardInfo] = field(default_factory=list)
    partial_records: int = 0
    truncated_bytes: int = 0
    truncated_lines: int = 0
    rebuilt: list[str] = field(default_factory=list)


def record_id(line: bytes) -> str | None:
    """The id of one record line, read from its prefix only; ``None`` when the line is not a record."""
    match = ID_PREFIX_RE.match(line)
    if match is None:
        return None
    try:
        value = orjson.loads(match.group(1))
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def iter_ids(path: Path) -> Iterator[str]:
    """Ids of every record in a finalized shard file."""
    with path.open("rb") as handle:
        for line in handle:
            rid = record_id(line)
            if rid is not None:
                yield rid


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class ShardStore:
    """Writes records to shards of ``shard_size`` lines; one writer per output directory."""

    def __init__(self, directory: Path, shard_size: int, on_finalize: Callable[[ShardInfo], None]) -> None:
        self.directory = directory
        self.shard_size = shard_size
        self.on_finalize = on_finalize
        self.done: set[str] = set()
        self._index = 0
        self._fd: int | None = None
        self._count = 0
        self._ids: list[str] = []
        self._hash = hashlib.sha256()
        self._buffer = bytearray()

    # --- opening -------------------------------------------------------------------------

    def open(self, known: dict[str, ShardInfo]) -> OpenReport:
        """Scans existing shards (``known`` from the manifest), repairs a torn tail, loads done ids."""
        self.directory.mkdir(parents=True, exist_ok=True)
        report = OpenReport()
        finals: list[tuple[int, Path]] = []
        partials: list[tuple[int, Path]] = []
        for path in self.directory.iterdir():
            match = SHARD_RE.match(path.name)
            if match:
                (partials if match.group(2) else finals).append((int(match.group(1)), path))
        for index, path in sorted(finals):
            info = self._load_final(path, known.get(path.name), report)
            report.finalized.append(info)
            self._index = max(self._index, index + 1)
        if len(partials) > 1:
            names = ", ".join(p.name for _, p in sorted(partials))
            raise write_error(self.directory, OSError(f"more than one partial shard ({names}); keep one"))
        if partials:
            index, path = partials[0]
            self._index = max(self._index, index)
            self._reopen_partial(path, report)
        return report

    def _load_final(self, path: Path, info: ShardInfo | None, report: OpenReport) -> ShardInfo:
        ids_path = path.with_suffix(".ids")
        ids: list[str] | None = None
        if info is not None and ids_path.is_file():
            ids = ids_path.read_text(encoding="utf-8").splitlines()
            if len(ids) != info.records:
                ids = None
        if ids is None or info is None:
            ids = list(iter_ids(path))
            info = ShardInfo(path.name, len(ids), file_sha256(path))
            write_atomic(ids_path, "".join(f"{i}\n" for i in ids).encode())
            report.rebuilt.append(path.name)
        self.done.update(ids)
        return info

    def _reopen_partial(self, path: Path, report: OpenReport) -> None:
        good = 0
        with path.open("rb") as handle:
            for line in handle:
                rid = record_id(line) if line.endswith(b"\n") else None
                if rid is None or rid in self.done:
                    break
                self.done.add(rid)
                self._ids.append(rid)
                self._hash.update(line)
                good += len(line)
        size = path.stat().st_size
        if size > good:
            report.truncated_bytes = size - good
            with path.open("rb") as handle:
                handle.seek(good)
                report.truncated_lines = max(1, handle.read().count(b"\n"))
            os.truncate(path, good)
        self._count = len(self._ids)
        report.partial_records = self._count
        self._open_fd(path)
        if self._count >= self.shard_size:
            self._finalize()

    # --- writing -------------------------------------------------------------------------

    def append(self, rid: str, line: bytes) -> None:
        """Appends one record line (ending in a newline) unless ``rid`` is already stored."""
        if rid in self.done:
            return
        if self._fd is None:
            self._open_fd(self.directory / (shard_name(self._index) + ".partial"))
        self._buffer += line
        self._hash.update(line)
        self._ids.append(rid)
        self.done.add(rid)
        self._count += 1
        if len(self._buffer) >= WRITE_BUFFER_BYTES:
            self._write_buffer()
        if self._count >= self.shard_size:
            self._finalize()

    def finish(self) -> None:
        """The run is complete: the last, short shard is finalized too (a later resume starts a new one)."""
        if self._count:
            self._finalize()

    def checkpoint(self) -> None:
        """Everything appended so far is on disk after this returns."""
        self._write_buffer()
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise write_error(self._partial_path, exc) from exc

    def close(self) -> None:
        """Checkpoints and closes the partial shard (it stays partial until full)."""
        try:
            self.checkpoint()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @property
    def _partial_path(self) -> Path:
        return self.directory / (shard_name(self._index) + ".partial")

    def _open_fd(self, path: Path) -> None:
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            fsync_dir(self.directory)
        except OSError as exc:
            raise write_error(path, exc) from exc

    def _write_buffer(self) -> None:
        if not self._buffer or self._fd is None:
            return
        view = memoryview(self._buffer)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            # Keep the file ending on a whole line: drop the part of this buffer that landed.
            self._truncate_to_last_newline()
            raise write_error(self._partial_path, exc) from exc
        finally:
            view.release()
        self._buffer.clear()

    def _truncate_to_last_newline(self) -> None:
        path = self._partial_path
        try:
            with path.open("rb") as handle:
                data = handle.read()
            os.truncate(path, data.rfind(b"\n") + 1)
        except OSError:
            pass

    def _finalize(self) -> None:
        partial = self._partial_path
        final = self.directory / shard_name(self._index)
        self.checkpoint()
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        write_atomic(final.with_suffix(".ids"), "".join(f"{i}\n" for i in self._ids).encode())
        try:
            os.replace(partial, final)
            fsync_dir(self.directory)
        except OSError as exc:
            raise write_error(final, exc) from exc
        info = ShardInfo(final.name, self._count, self._hash.hexdigest())
        self._index += 1
        self._count = 0
        self._ids = []
        self._hash = hashlib.sha256()
        self.on_finalize(info)
