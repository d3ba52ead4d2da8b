"""Writers of the four export formats, each into a staging directory that becomes ``--out`` at the end.

=====================  =============================================================================
``specforge``          ``train.jsonl``: ``{"input_ids": [...], "loss_mask": [...]}`` per line, SpecForge
                       0.2.0's pre-tokenized prompts file (``data.prompts_path``)
``speculators``        ``train.jsonl``: ``{"id", "input_ids", "loss_mask", "metadata"}`` per line, for
                       speculators 0.9.0's ``prepare-data --data OUT/train.jsonl``
``speculators-dataset`` the directory itself: a Hugging Face ``save_to_disk`` dataset (``input_ids``,
                       ``loss_mask``: int64 lists, ``seq_len``: int64) with the torch format persisted, as
                       speculators' ``ArrowDataset`` loads it (``--data-path OUT``)
``parquet``            ``train.parquet``: ``id, input_ids, loss_mask, prompt_len, finish_reason,
                       conversation, turn``, the manifest's plan in the file's key-value metadata
=====================  =============================================================================

The JSONL writers copy the ids as stored and never decode them; the Arrow writers build one record batch per
:data:`BATCH_TOKENS` ids, so memory stays flat whatever the data set's size.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol

import orjson

from eagle_datagen.export.deps import need
from eagle_datagen.export.rows import TrainRow

Format = Literal["specforge", "speculators", "speculators-dataset", "parquet"]
FORMATS: tuple[Format, ...] = ("specforge", "speculators", "speculators-dataset", "parquet")
JSONL_NAME = "train.jsonl"
PARQUET_NAME = "train.parquet"
WRITE_BUFFER = 1 << 20
#: ids per Arrow record batch (and so per Parquet row group at most)
BATCH_TOKENS = 1 << 22
BATCH_ROWS = 4096


class Writer(Protocol):
    def write(self, row: TrainRow) -> None: ...

    def close(self) -> list[str]:
        """Finishes the files; returns their names relative to the staging directory."""
        ...

    def abort(self) -> None: ...


def check_dependencies(fmt: Format) -> None:
    """Fails before any work when the format's optional dependency is missing."""
    if fmt == "parquet":
        need("pyarrow.parquet", "--format parquet")
    elif fmt == "speculators-dataset":
        need("pyarrow", "--format speculators-dataset")
        need("datasets", "--format speculators-dataset")
        need("torch", "--format speculators-dataset (the torch format is persisted in the dataset)")


def open_writer(fmt: Format, staging: Path, *, plan: dict[str, Any], plan_sha256: str) -> Writer:
    if fmt == "specforge":
        return SpecForgeWriter(staging / JSONL_NAME)
    if fmt == "speculators":
        return SpeculatorsWriter(staging / JSONL_NAME)
    if fmt == "parquet":
        return ParquetWriter(staging / PARQUET_NAME, plan=plan, plan_sha256=plan_sha256)
    return SpeculatorsDatasetWriter(staging)


class _JsonlWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: BinaryIO = path.open("wb", buffering=WRITE_BUFFER)

    def close(self) -> list[str]:
        self.handle.close()
        return [self.path.name]

    def abort(self) -> None:
        self.handle.close()


class SpecForgeWriter(_JsonlWriter):
    """SpecForge reads ``input_ids`` and ``loss_mask`` only (``prompt_builder._prompt_from_record``)."""

    def write(self, row: TrainRow) -> None:
        self.handle.write(
            b"".join([b'{"input_ids":[', *row.ids_parts(), b'],"loss_mask":[', *row.mask_parts(), b"]}\n"])
        )


class SpeculatorsWriter(_JsonlWriter):
    """speculators' ``prepare-data`` keeps ``input_ids`` / ``loss_mask``; ``id`` and ``metadata`` are for people
    (it drops them). ``metadata`` has the same keys and types on every row: ``datasets`` infers one schema."""

    def write(self, row: TrainRow) -> None:
        metadata = {
            "key": row.key,
            "sample": row.sample,
            "finish_reason": row.finish,
            "prompt_len": row.prompt_len,
            "conversation": row.conversation,
            "turn": row.turn,
            "turns": row.turns,
        }
        self.handle.write(
            b"".join(
                [
                    b'{"id":',
                    orjson.dumps(row.id),
                    b',"input_ids":[',
                    *row.ids_parts(),
                    b'],"loss_mask":[',
                    *row.mask_parts(),
                    b'],"metadata":',
                    orjson.dumps(metadata),
                    b"}\n",
                ]
            )
        )


class _ArrowBatches:
    """Collects rows and hands out a ``pyarrow.RecordBatch`` every :data:`BATCH_TOKENS` ids.

    ``input_ids`` / ``loss_mask`` are built per batch, not per row: the rows' id texts are joined and parsed
    in one ``orjson.loads`` into one int64 array, the masks expanded from their runs with ``numpy.repeat``,
    and both wrapped as list arrays over shared offsets. The other columns are plain lists."""

    def __init__(self, schema: Any) -> None:
        self.pa = need("pyarrow", "the Arrow formats")
        self.np = need("numpy", "the Arrow formats")
        self.schema = schema
        self.columns: dict[str, list[Any]] = {n: [] for n in schema.names if n not in ("input_ids", "loss_mask")}
        self.parts: list[Any] = []
        self.lengths: list[int] = []
        self.mask_values: list[int] = []
        self.mask_counts: list[int] = []
        self.tokens = 0

    def add(self, row: TrainRow, values: dict[str, Any]) -> bool:
        for name, column in self.columns.items():
            column.append(values[name])
        if self.parts:
            self.parts.append(b",")
        self.parts += row.ids_parts()
        self.lengths.append(row.length)
        for _, n, m in row.segments:
            self.mask_values.append(m)
            self.mask_counts.append(n)
        self.tokens += row.length
        return self.tokens >= BATCH_TOKENS or len(self.lengths) >= BATCH_ROWS

    def take(self) -> Any:
        pa, np = self.pa, self.np
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=offsets[1:])
        flat = np.array(orjson.loads(b"".join([b"[", *self.parts, b"]"])), dtype=np.int64)
        ids_type = self.schema.field("input_ids").type
        mask_type = self.schema.field("loss_mask").type
        mask = np.repeat(np.array(self.mask_values, dtype=mask_type.value_type.to_pandas_dtype()), self.mask_counts)
        arrays = {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=ids_type.value_type)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask, type=mask_type.value_type)),
        }
        for name, column in self.columns.items():
            arrays[name] = pa.array(column, type=self.schema.field(name).type)
            column.clear()
        self.parts.clear()
        self.lengths.clear()
        self.mask_values.clear()
        self.mask_counts.clear()
        self.tokens = 0
        return pa.record_batch([arrays[f.name] for f in self.schema], schema=self.schema)

    def __len__(self) -> int:
        return len(self.lengths)


class ParquetWriter:
    def __init__(self, path: Path, *, plan: dict[str, Any], plan_sha256: str) -> None:
        pa = need("pyarrow", "--format parquet")
        pq = need("pyarrow.parquet", "--format parquet")
        self.path = path
        schema = pa.schema(
            [
                ("id", pa.string()),
                ("input_ids", pa.list_(pa.int64())),
                ("loss_mask", pa.list_(pa.int8())),
                ("prompt_len", pa.int64()),
                ("finish_reason", pa.string()),
                ("conversation", pa.string()),
                ("turn", pa.int64()),
            ],
            metadata={
                "eagle_datagen.plan": orjson.dumps(plan),
                "eagle_datagen.plan_sha256": plan_sha256,
            },
        )
        self.batches = _ArrowBatches(schema)
        self.writer = pq.ParquetWriter(str(path), schema)

    def write(self, row: TrainRow) -> None:
        full = self.batches.add(
            row,
            {
                "id": row.id,
                "prompt_len": row.prompt_len,
                "finish_reason": row.finish,
                "conversation": row.conversation,
                "turn": row.turn,
            },
        )
        if full:
            self.writer.write_batch(self.batches.take())

    def close(self) -> list[str]:
        if len(self.batches):
            self.writer.write_batch(self.batches.take())
        self.writer.close()
        return [self.path.name]

    def abort(self) -> None:
        self.writer.close()


class SpeculatorsDatasetWriter:
    """Rows go to one Arrow stream file beside the staging directory; :meth:`close` opens it memory-mapped
    with ``datasets.Dataset.from_file``, persists ``set_format("torch")`` and ``save_to_disk``s it (speculators'
    ``ArrowDataset`` needs the torch format on disk: its ``torch.equal`` guard fails on lists)."""

    def __init__(self, staging: Path) -> None:
        pa = need("pyarrow", "--format speculators-dataset")
        need("datasets", "--format speculators-dataset")
        self.staging = staging
        self.scratch = staging.with_name(staging.name + ".arrow-tmp")
        self.scratch.mkdir()
        self.arrow_path = self.scratch / "rows.arrow"
        schema = pa.schema(
            [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())]
        )
        self.batches = _ArrowBatches(schema)
        self.sink = pa.OSFile(str(self.arrow_path), "wb")
        self.writer = pa.ipc.new_stream(self.sink, schema)

    def write(self, row: TrainRow) -> None:
        if self.batches.add(row, {"seq_len": row.length}):
            self.writer.write_batch(self.batches.take())

    def close(self) -> list[str]:
        datasets = need("datasets", "--format speculators-dataset")
        if len(self.batches):
            self.writer.write_batch(self.batches.take())
        self.writer.close()
        self.sink.close()
        try:
            datasets.disable_progress_bars()
            dataset = datasets.Dataset.from_file(str(self.arrow_path))
            dataset.set_format("torch")
            dataset.save_to_disk(str(self.staging))
            del dataset
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return sorted(p.name for p in self.staging.iterdir())

    def abort(self) -> None:
        self.writer.close()
        self.sink.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
