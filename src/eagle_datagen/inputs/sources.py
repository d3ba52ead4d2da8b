"""Where prompt rows come from, and how the plan pins them.

``--prompts`` takes any of:

* a JSONL file, plain, gzip (``.jsonl.gz``) or zstandard (``.jsonl.zst``, needs ``zstandard``);
* a Parquet file, or a directory of them (read in row batches with ``pyarrow``);
* a Hugging Face dataset saved with ``save_to_disk`` (its Arrow files, read with ``pyarrow``; ``datasets``
  itself is not needed);
* a directory of JSONL files (plain or compressed, one kind).

Every source yields ``(file, row, raw JSON bytes)``, so one parser (:func:`prompts.parse_row`) validates
every shape and every error names ``file:row``. Table rows map to the same three row shapes: the columns
``id``, ``messages``, ``conversations``, ``prompt`` and ``tools`` are taken as they are (a string holding JSON
is parsed for ``messages``, ``conversations`` and ``tools``, as datasets often store them), and
``--prompt-column`` / ``--messages-column`` name other columns.

:func:`PromptSource.identity` is what the plan pins. A plain JSONL file keeps the 0.1 form (path, size,
sha256, lines). Other sources list each file with its size and sha256; for Parquet the sha256 covers the
footer (schema, row groups, their statistics) plus the file size rather than the whole file, which is
stated in each entry's ``hashed`` field.
"""

from __future__ import annotations

import gzip
import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import orjson

from eagle_datagen.errors import BadInputError, UsageError

SourceKind = Literal["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow"]
KNOWN_COLUMNS = ("id", "messages", "conversations", "prompt", "tools")
_CONVERSATION_COLUMNS = ("messages", "conversations", "prompt")
_JSON_STRING_COLUMNS = ("messages", "conversations", "tools")
_BATCH_ROWS = 1024
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class Columns:
    """Which table columns hold the conversation, when they are not named as the row shapes are."""

    prompt: str | None = None
    messages: str | None = None

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in (("prompt", self.prompt), ("messages", self.messages)) if v is not None}


@dataclass(frozen=True, slots=True)
class PromptSource:
    """An opened ``--prompts`` path: its kind and its files, in reading order."""

    path: Path
    kind: SourceKind
    files: tuple[Path, ...]
    columns: Columns = Columns()

    def rows(self) -> Iterator[tuple[str, int, bytes]]:
        """``(file, row, raw JSON)`` for every row of every file; ``row`` counts from 1 in each file."""
        for file in self.files:
            if self.kind == "parquet":
                yield from _table_rows(file, _parquet_batches(file), self.columns)
            elif self.kind == "arrow":
                yield from _table_rows(file, _arrow_batches(file), self.columns)
            else:
                with _open_text_lines(file, self.kind) as handle:
                    for line_no, raw in enumerate(handle, start=1):
                        yield str(file), line_no, raw

    def identity(self) -> dict[str, Any]:
        """What the plan pins; see the module docstring."""
        if self.kind == "jsonl" and self.files == (self.path,):
            return file_identity(self.path)
        entries = [_file_identity(file, self.kind, self._name(file)) for file in self.files]
        identity: dict[str, Any] = {
            "path": str(self.path.resolve()),
            "kind": self.kind,
            "files": entries,
            "lines": sum(e["rows"] for e in entries),
        }
        if self.columns.to_json():
            identity["columns"] = self.columns.to_json()
        return identity

    def _name(self, file: Path) -> str:
        return file.name if file == self.path else str(file.relative_to(self.path))


def open_source(path: Path, columns: Columns = Columns()) -> PromptSource:
    """Finds the kind and the files of ``path``; raises :class:`UsageError` naming what is wrong."""
    if path.is_file():
        kind = _file_kind(path)
        if kind is None:
            raise UsageError(
                f"--prompts {path}: unknown file type; give a .jsonl, .jsonl.gz, .jsonl.zst or .parquet file, "
                "or a directory of them"
            )
        source = PromptSource(path, kind, (path,), columns)
    elif path.is_dir():
        source = _open_directory(path, columns)
    else:
        raise UsageError(f"--prompts {path} does not exist")
    if source.kind in ("parquet", "arrow"):
        _check_columns(source)
    elif columns.to_json():
        raise UsageError("--prompt-column and --messages-column apply to Parquet and Arrow inputs, not to JSONL")
    return source


def _file_kind(path: Path) -> SourceKind | None:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    if name.endswith((".jsonl.gz", ".json.gz")):
        return "jsonl.gz"
    if name.endswith((".jsonl.zst", ".json.zst")):
        return "jsonl.zst"
    if name.endswith((".jsonl", ".json", ".ndjson")) or "." not in name:
        return "jsonl"
    return None


def _open_directory(path: Path, columns: Columns) -> PromptSource:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise UsageError(
            f"--prompts {path} is a DatasetDict with splits {splits}; give one split's directory, "
            f"e.g. --prompts {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if state.is_file():  # Dataset.save_to_disk
        try:
            names = [entry["filename"] for entry in orjson.loads(state.read_bytes())["_data_files"]]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise UsageError(f"{state}: not a datasets save_to_disk state file ({exc})") from None
        return PromptSource(path, "arrow", tuple(path / n for n in names), columns)
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".") and "." in p.name)
    present: dict[SourceKind, list[Path]] = {}
    for file in files:
        kind = _file_kind(file)
        if kind is not None:
            present.setdefault(kind, []).append(file)
    if not present:
        raise UsageError(f"--prompts {path}: the directory holds no .parquet, .jsonl, .jsonl.gz or .jsonl.zst files")
    if len(present) > 1:
        raise UsageError(
            f"--prompts {path} mixes {', '.join(sorted(present))} files; put one kind of file in the directory"
        )
    ((kind, found),) = present.items()
    return PromptSource(path, kind, tuple(found), columns)


def _open_text_lines(file: Path, kind: SourceKind) -> IO[bytes]:
    try:
        if kind == "jsonl.gz":
            return gzip.open(file, "rb")  # type: ignore[return-value]
        if kind == "jsonl.zst":
            zstandard = _import("zstandard", "reading .jsonl.zst prompts")
            raw = file.open("rb")
            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), 1 << 20)
        return file.open("rb")
    except OSError as exc:
        raise UsageError(f"{file}: cannot open the prompts file ({exc.strerror})") from exc


def _import(module: str, what: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        extra = "inputs"
        raise UsageError(
            f"{what} needs the '{module}' package: pip install 'eagle-datagen[{extra}]' (or pip install {module})"
        ) from None


def _parquet_batches(file: Path) -> Iterator[Any]:
    _import("pyarrow", "reading Parquet prompts")
    import pyarrow.parquet as pq

    yield from pq.ParquetFile(file).iter_batches(batch_size=_BATCH_ROWS)


def _arrow_batches(file: Path) -> Iterator[Any]:
    pa = _import("pyarrow", "reading a saved Hugging Face dataset")
    import pyarrow.ipc

    with pa.memory_map(str(file)) as source:
        try:
            reader = pyarrow.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pyarrow.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def _schema_names(source: PromptSource, file: Path) -> list[str]:
    if source.kind == "parquet":
        _import("pyarrow", "reading Parquet prompts")
        import pyarrow.parquet as pq

        return list(pq.read_schema(file).names)
    for batch in _arrow_batches(file):
        return list(batch.schema.names)
    return []


def _check_columns(source: PromptSource) -> None:
    """Every file has a conversation column; a named column exists. Raised before any work starts."""
    for file in source.files:
        names = _schema_names(source, file)
        wanted = [c for c in (source.columns.prompt, source.columns.messages) if c is not None]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise UsageError(f"{file}: no column {missing[0]!r}; its columns are {names}")
        if not wanted and not any(c in names for c in _CONVERSATION_COLUMNS):
            raise UsageError(
                f"{file} has none of the columns {', '.join(_CONVERSATION_COLUMNS)}; its columns are {names}. "
                "Name the one that holds the conversation: --messages-column NAME (a list of {role, content}) "
                "or --prompt-column NAME (one user turn)"
            )


def _table_rows(file: Path, batches: Iterator[Any], columns: Columns) -> Iterator[tuple[str, int, bytes]]:
    name = str(file)
    row = 0
    for batch in batches:
        for values in batch.to_pylist():
            row += 1
            yield name, row, _row_json(values, columns, name, row)


def _row_json(values: dict[str, Any], columns: Columns, file: str, row: int) -> bytes:
    obj: dict[str, Any] = {}
    if values.get("id") is not None:
        obj["id"] = values["id"]
    if columns.prompt is not None:
        obj["prompt"] = values[columns.prompt]
    elif columns.messages is not None:
        obj["messages"] = values[columns.messages]
    else:
        for name in _CONVERSATION_COLUMNS:
            if values.get(name) is not None:
                obj[name] = values[name]
    if values.get("tools") is not None:
        obj["tools"] = values["tools"]
    for name in _JSON_STRING_COLUMNS:
        text = obj.get(name)
        if isinstance(text, str) and text.lstrip().startswith(("[", "{")):
            try:
                obj[name] = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise BadInputError(
                    file,
                    row,
                    "invalid_json",
                    f"column {name!r} holds a string that is not valid JSON ({exc})",
                    "fix the row, or pass --skip-bad-lines to set such rows aside in rejects.jsonl",
                ) from None
    try:
        return orjson.dumps(obj, default=_jsonable)
    except TypeError as exc:
        raise BadInputError(
            file,
            row,
            "bad_value",
            f"a column value cannot be read as JSON ({exc})",
            "store the conversation as lists, structs and strings",
        ) from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    raise TypeError(f"type {type(value).__name__}")


def file_identity(path: Path) -> dict[str, Any]:
    """Path, size, sha256 and line count of one plain file: the 0.1 pin of a JSONL prompts file."""
    digest = hashlib.sha256()
    size = lines = 0
    last = b"\n"
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    if size and last != b"\n":
        lines += 1
    return {"path": str(path.resolve()), "size": size, "sha256": digest.hexdigest(), "lines": lines}


def _file_identity(file: Path, kind: SourceKind, name: str) -> dict[str, Any]:
    size = file.stat().st_size
    if kind == "parquet":
        _import("pyarrow", "reading Parquet prompts")
        import pyarrow.parquet as pq

        with file.open("rb") as handle:
            handle.seek(-8, 2)
            tail = handle.read(8)
            footer_len = int.from_bytes(tail[:4], "little")
            if tail[4:] != b"PAR1" or footer_len + 8 > size:
                raise UsageError(f"{file}: not a Parquet file (no PAR1 footer)")
            handle.seek(-(footer_len + 8), 2)
            digest = hashlib.sha256(handle.read(footer_len + 8))
        digest.update(str(size).encode())
        rows = pq.ParquetFile(file).metadata.num_rows
        return {
            "name": name,
            "size": size,
            "sha256": digest.hexdigest(),
            "hashed": "parquet footer + size",
            "rows": rows,
        }
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    if kind == "arrow":
        rows = sum(batch.num_rows for batch in _arrow_batches(file))
    else:
        rows = 0
        with _open_text_lines(file, kind) as lines:
            for raw in lines:
                rows += 1 if raw.strip() else 0
    return {"name": name, "size": size, "sha256": digest.hexdigest(), "hashed": "whole file", "rows": rows}
