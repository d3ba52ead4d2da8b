"""Append-only JSONL shards that survive ``kill -9``.

Layout under ``DIR/shards/``::

    shard_00000.jsonl      finalized: closed, fsynced, its count and sha256 in the manifest
    shard_00000.ids        the ids it holds, one per line (so resume never re-parses token lists)
    shard_00001.jsonl.partial   the shard being written

Each record is handed to the kernel (one ``os.write`` of its whole line) the moment it is accepted, so a
process death (``kill -9``, OOM, SIGKILL after a grace period) loses no accepted record. ``fsync`` at
checkpoints, at a finalize and at the first stop signal bounds what an OS crash or a power loss can take;
such a crash can leave a torn last line, which :meth:`ShardStore.open` truncates away (and says so). The
shards are the truth: ``.ids`` files and the manifest are rebuilt from them when they disagree.

One writer per directory (``store/lock.py``). :meth:`ShardStore.open` also adopts what two writers of an
older version may have left: a ``.partial`` below finalized shards keeps its own index (or gets a fresh
one when a finalized shard holds that name), records it shares with other shards are dropped, and every
``.partial`` but the last is finalized as a short shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.store.durable import FILE_MODE, fsync_dir, sweep_temp_files, write_atomic, write_error

SHARD_RE = re.compile(r"^shard_(\d{5,})\.jsonl(\.partial)?$")
#: Records start with their id (orjson keeps insertion order), so resume reads just that much.
ID_PREFIX_RE = re.compile(rb'^\{"id":("(?:[^"\\]|\\.)*")')


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
    #: ``.NAME.XXXX.tmp`` files a crash inside ``write_atomic`` left, removed.
    swept: list[str] = field(default_factory=list)
    #: Partials that were out of place (``"old → new"`` when renamed, else the name), adopted.
    adopted: list[str] = field(default_factory=list)
    #: Records of a partial that other shards already hold (two writers), dropped from it.
    duplicates_dropped: int = 0


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
    """Writes records to shards of ``shard_size`` lines; one writer per output directory (``DIR/.lock``)."""

    def __init__(self, directory: Path, shard_size: int, on_finalize: Callable[[ShardInfo], None]) -> None:
        self.directory = directory
        self.shard_size = shard_size
        self.on_finalize = on_finalize
        self.done: set[str] = set()
        self._index = 0  # of the partial being written, or of the next one
        self._next = 0  # above every shard index present
        self._fd: int | None = None
        self._size = 0  # bytes of whole lines in the partial
        self._count = 0
        self._ids: list[str] = []
        self._hash = hashlib.sha256()

    # --- opening -------------------------------------------------------------------------

    def open(self, known: dict[str, ShardInfo]) -> OpenReport:
        """Scans existing shards (``known`` from the manifest), repairs a torn tail, loads done ids."""
        self.directory.mkdir(parents=True, exist_ok=True)
        report = OpenReport(swept=sweep_temp_files(self.directory))
        finals: list[tuple[int, Path]] = []
        partials: list[tuple[int, Path]] = []
        for path in self.directory.iterdir():
            match = SHARD_RE.match(path.name)
            if match:
                (partials if match.group(2) else finals).append((int(match.group(1)), path))
        for _, path in sorted(finals):
            info = self._load_final(path, known.get(path.name), report)
            report.finalized.append(info)
        taken = {index for index, _ in finals}
        self._next = max([0, *(index + 1 for index, _ in finals + partials)])
        partials.sort()
        for n, (index, path) in enumerate(partials):
            last = n == len(partials) - 1
            if index in taken:  # two writers: a finalized shard already has this partial's name
                renamed = self.directory / (shard_name(self._next) + ".partial")
                self._rename(path, renamed)
                report.adopted.append(f"{path.name} → {renamed.name}")
                index, path = self._next, renamed
                self._next += 1
            elif not last or index + 1 < self._next:
                report.adopted.append(path.name)
            self._index = index
            self._reopen_partial(path, report)
            if not last and self._fd is not None:
                if self._count:
                    self._finalize()  # an extra partial becomes a short shard
                else:
                    self._discard_partial()
        if self._fd is None:
            self._index = self._next
        return report

    def _load_final(self, path: Path, info: ShardInfo | None, report: OpenReport) -> ShardInfo:
        ids_path = path.with_suffix(".ids")
        ids: list[str] | None = None
        if info is not None and ids_path.is_file():
            ids = _read_ids(ids_path)
            if ids is not None and len(ids) != info.records:
                ids = None
        if ids is None or info is None:
            ids = list(iter_ids(path))
            info = ShardInfo(path.name, len(ids), file_sha256(path))
            write_atomic(ids_path, "".join(f"{i}\n" for i in ids).encode())
            report.rebuilt.append(path.name)
        self.done.update(ids)
        return info

    def _reopen_partial(self, path: Path, report: OpenReport) -> None:
        """Keeps the partial's whole, parseable lines up to the first torn one, minus records other
        shards already hold (only two writers leave those)."""
        kept: list[bytes] = []
        duplicates = 0
        torn = 0
        good = 0
        with path.open("rb") as handle:
            for line in handle:
                rid = record_id(line) if line.endswith(b"\n") else None
                if rid is None:
                    break
                good += len(line)
                if rid in self.done:
                    duplicates += 1
                    continue
                self.done.add(rid)
                self._ids.append(rid)
                self._hash.update(line)
                kept.append(line)
        size = path.stat().st_size
        if size > good:
            torn = size - good
            with path.open("rb") as handle:
                handle.seek(good)
                report.truncated_lines += max(1, handle.read().count(b"\n"))
            report.truncated_bytes += torn
        if duplicates:
            report.duplicates_dropped += duplicates
            write_atomic(path, b"".join(kept))
        elif torn:
            os.truncate(path, good)
        self._count = len(self._ids)
        self._size = sum(len(line) for line in kept)
        report.partial_records += self._count
        self._open_fd(path)
        if self._count >= self.shard_size:
            self._finalize()

    # --- writing -------------------------------------------------------------------------

    def append(self, rid: str, line: bytes) -> None:
        """Appends one record line (ending in a newline) unless ``rid`` is already stored.

        The line reaches the kernel before this returns (one ``os.write``): a process death from now on
        cannot lose it; an OS crash before the next :meth:`checkpoint` can.
        """
        if rid in self.done:
            return
        if self._fd is None:
            self._open_fd(self._partial_path)
        self._write(line)
        self._hash.update(line)
        self._ids.append(rid)
        self.done.add(rid)
        self._count += 1
        if self._count >= self.shard_size:
            self._finalize()

    def finish(self) -> None:
        """The run is complete: the last, short shard is finalized too (a later resume starts a new one)."""
        if self._count:
            self._finalize()

    def checkpoint(self) -> None:
        """Everything appended so far survives an OS crash or power loss after this returns (fsync)."""
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
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            fsync_dir(self.directory)
        except OSError as exc:
            raise write_error(path, exc) from exc

    def _write(self, line: bytes) -> None:
        assert self._fd is not None
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            # Keep the file ending on a whole line: cut off the part of this line that landed.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise write_error(self._partial_path, exc) from exc
        finally:
            view.release()
        self._size += len(line)

    def _rename(self, source: Path, target: Path) -> None:
        try:
            os.replace(source, target)
            fsync_dir(self.directory)
        except OSError as exc:
            raise write_error(target, exc) from exc

    def _discard_partial(self) -> None:
        """An extra partial left without a record of its own: removed."""
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        path = self._partial_path
        try:
            os.unlink(path)
            fsync_dir(self.directory)
        except OSError as exc:
            raise write_error(path, exc) from exc
        self._reset()

    def _finalize(self) -> None:
        partial = self._partial_path
        final = self.directory / shard_name(self._index)
        self.checkpoint()
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        write_atomic(final.with_suffix(".ids"), "".join(f"{i}\n" for i in self._ids).encode())
        self._rename(partial, final)
        info = ShardInfo(final.name, self._count, self._hash.hexdigest())
        self._reset()
        self.on_finalize(info)

    def _reset(self) -> None:
        self._next = max(self._next, self._index + 1)
        self._index = self._next
        self._count = 0
        self._size = 0
        self._ids = []
        self._hash = hashlib.sha256()


def read_records(directory: Path, wanted: set[str]) -> dict[str, dict[str, Any]]:
    """The records with the ids in ``wanted``, read back from the shards of ``directory`` (newest shard first,
    stopping once all are found; a line is parsed only when its id prefix is wanted)."""
    found: dict[str, dict[str, Any]] = {}
    if not wanted or not directory.is_dir():
        return found
    shards = sorted((p for p in directory.iterdir() if SHARD_RE.match(p.name)), key=lambda p: p.name, reverse=True)
    for path in shards:
        with path.open("rb") as handle:
            for line in handle:
                rid = record_id(line)
                if rid is None or rid not in wanted or rid in found or not line.endswith(b"\n"):
                    continue
                with contextlib.suppress(orjson.JSONDecodeError):
                    value = orjson.loads(line)
                    if isinstance(value, dict):
                        found[rid] = value
        if len(found) == len(wanted):
            break
    return found


def shard_ids(path: Path, records: int) -> list[str]:
    """The ids of the finalized shard ``path``: its ``.ids`` sidecar when it is whole and holds ``records`` ids
    (the manifest's count), else read from the shard itself (the shards are the truth)."""
    ids = _read_ids(path.with_suffix(".ids"))
    return ids if ids is not None and len(ids) == records else list(iter_ids(path))


def _read_ids(path: Path) -> list[str] | None:
    """The ids of a ``.ids`` sidecar, split on ``\\n`` only (ids may hold U+2028 and other separators);
    ``None`` when it is not a whole, UTF-8 sidecar."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text:
        return []
    if not text.endswith("\n"):
        return None
    return text[:-1].split("\n")
