"""``verify-shard``: prove, record by record, that finished shards are exact.

The shards are streamed once. Per record it runs the very check the client ran before writing
(:func:`eagle_datagen.record.checks.check_record`: ids in the vocabulary, the finish, the model family's reasoning
or harmony structure) and what only the whole data set shows: ids unique across shards, the stored prompt
against a fresh render of its source row, and each shard against the count and sha256 the manifest recorded at
finalize. A run directory
brings its manifest (plan and tokenizer facts); bare shard files are checked against ``--tokenizer``
when given, and the report lists what could not be checked.

Every finding has a short, stable ``kind``:

errors    parse, torn_line, schema, id_mismatch, duplicate_id, the record check's kinds (out_of_vocab,
          empty_output, completion_tokens, prompt_tail_leak, stop_token, length, abort, nan_finish,
          finish_reason, think_twice, think_reopened, think_closed_twice, think_unopened, think_when_off,
          think_prompt, channel_structure), prompt_mismatch, prompt_row_missing, render_error,
          shard_count, shard_checksum, shard_missing; --turns all runs (verify/turns.py): turn_history,
          turn_end, turn_missing, turn_after_end, and with --server-url reply_mismatch, reply_unchecked
warnings  stop_in_reasoning, tool_call_ends_reasoning, torn_line (live partial shard), shard_unrecorded,
          prompts_changed, tokenizer_changed, conversation_open

Speed (docs/verify.md): orjson per line, the id types proven on the line's own compact bytes
(``bytes.translate``), and C-level list operations in the record check, so no Python loop ever runs over the
ids of a well-formed record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from eagle_datagen.errors import BadInputError, UsageError
from eagle_datagen.inputs.prompts import PromptRow, parse_row
from eagle_datagen.inputs.render import (
    Renderer,
    RowRenderer,
    load_tokenizer,
    model_vocab_size,
    renderer_for_plan,
    tokenizer_facts,
    tokenizer_fingerprint,
)
from eagle_datagen.inputs.sources import Columns, open_source
from eagle_datagen.record.checks import Problem, RecordSpec, check_record
from eagle_datagen.record.family import Family, detect_family
from eagle_datagen.record.turns import turn_id
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.store.shards import SHARD_RE, ShardInfo, record_id
from eagle_datagen.verify.turns import ReplyCheck, TurnChecker, first_difference

SHARDS_DIR = "shards"
RENDER_BATCH = 256
RENDER_CACHE = 4096
HUMAN_WARNING_EXAMPLES = 3

Severity = Literal["error", "warning"]
ShardState = Literal["finalized", "partial", "in_progress"]

#: ``(kind, path, line, id, message)`` of an error found outside the record loop.
ErrorSink = Callable[[str, str, int, str, str], None]

_PROMPT_KEY = b'"prompt_ids":['
_BETWEEN_LISTS = b'],"output_ids":['
#: What a JSON list of non-negative integers holds between its brackets.
_ID_LIST_BYTES = b"0123456789, \t\r\n"
_DIGITS_COMMAS = b"0123456789,"
READ_BUFFER = 1 << 20
_NEWLINE = ord("\n")
_FIELDS: tuple[tuple[str, type], ...] = (
    ("id", str),
    ("key", str),
    ("sample", int),
    ("prompt_ids", list),
    ("output_ids", list),
    ("finish_reason", dict),
    ("completion_tokens", int),
)


# --- the report ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One example of a problem: where it is and what is wrong."""

    kind: str
    path: str
    line: int | None
    id: str | None
    message: str

    def where(self) -> str:
        return self.path if self.line is None else f"{self.path}:{self.line}"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "id": self.id, "message": self.message}


@dataclass
class ShardResult:
    """What one shard file held and how it compares with the manifest."""

    path: str
    state: ShardState
    records: int = 0
    bytes: int = 0
    manifest_records: int | None = None
    checksum: Literal["ok", "mismatch", "not_recorded"] = "not_recorded"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "state": self.state,
            "records": self.records,
            "bytes": self.bytes,
            "manifest_records": self.manifest_records,
            "checksum": self.checksum,
        }


@dataclass
class Report:
    """Everything ``verify`` found: counts by kind, the first examples of each, and what was not checked."""

    max_examples: int = 20
    shards: list[ShardResult] = field(default_factory=list)
    records: int = 0
    bytes: int = 0
    elapsed_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    warnings: Counter[str] = field(default_factory=Counter)
    examples: dict[Severity, dict[str, list[Finding]]] = field(default_factory=lambda: {"error": {}, "warning": {}})
    not_checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.elapsed_s / 1e6 if self.elapsed_s > 0 else 0.0

    def add(self, severity: Severity, finding: Finding, count: int = 1) -> None:
        (self.errors if severity == "error" else self.warnings)[finding.kind] += count
        kept = self.examples[severity].setdefault(finding.kind, [])
        if len(kept) < self.max_examples:
            kept.append(finding)

    def skip(self, what: str) -> None:
        if what not in self.not_checked:
            self.not_checked.append(what)

    def to_json(self) -> dict[str, Any]:
        def kinds(severity: Severity, counts: Counter[str]) -> dict[str, Any]:
            return {
                kind: {"count": n, "examples": [f.to_json() for f in self.examples[severity].get(kind, [])]}
                for kind, n in sorted(counts.items())
            }

        return {
            "ok": self.ok,
            "records": self.records,
            "bytes": self.bytes,
            "elapsed_s": round(self.elapsed_s, 3),
            "mb_per_s": round(self.mb_per_s, 1),
            "shards": [s.to_json() for s in self.shards],
            "errors": kinds("error", self.errors),
            "warnings": kinds("warning", self.warnings),
            "not_checked": list(self.not_checked),
        }


def format_report(report: Report) -> str:
    """The human summary: shards, errors by kind with their first examples, warnings, what was not checked."""
    lines = [
        f"checked {report.records:,} records in {len(report.shards)} shard file(s), "
        f"{report.bytes / 1e6:,.1f} MB in {report.elapsed_s:.2f} s ({report.mb_per_s:,.0f} MB/s)"
    ]
    width = max((len(s.path) for s in report.shards), default=0)
    lines += [f"  {s.path:<{width}}  {s.records:>9,} records  {_shard_status(s)}" for s in report.shards]
    sections: tuple[tuple[Severity, Counter[str]], ...] = (("error", report.errors), ("warning", report.warnings))
    for severity, counts in sections:
        if not counts:
            continue
        lines.append(f"{severity}s: {sum(counts.values()):,}")
        for kind, n in sorted(counts.items()):
            lines.append(f"  {kind}: {n:,}")
            shown = report.examples[severity].get(kind, [])
            if severity == "warning":
                shown = shown[:HUMAN_WARNING_EXAMPLES]
            lines += [f"    {f.where()}{_id_part(f)}: {f.message}" for f in shown]
            if n > len(shown):
                lines.append(f"    ... and {n - len(shown):,} more")
    if report.not_checked:
        lines.append("not checked:")
        lines += [f"  - {what}" for what in report.not_checked]
    lines.append("OK: no errors" if report.ok else f"FAILED: {sum(report.errors.values()):,} error(s)")
    return "\n".join(lines)


def _shard_status(shard: ShardResult) -> str:
    if shard.state == "in_progress":
        return "in progress (a .partial shard: not finalized, not in the manifest yet)"
    if shard.state == "partial":
        return "partial (given explicitly: checked like a finished shard)"
    if shard.manifest_records is None:
        return "finalized; no manifest entry (count and sha256 not checked)"
    count = "count matches" if shard.records == shard.manifest_records else f"manifest says {shard.manifest_records:,}"
    return f"finalized; {count}; sha256 {'matches' if shard.checksum == 'ok' else 'MISMATCH'}"


def _id_part(finding: Finding) -> str:
    return "" if finding.id is None else f" id {finding.id!r}"


# --- what records are checked against ---------------------------------------------------------------


@dataclass
class PromptIndex:
    """Where each key's row starts in the prompts file (the rows themselves are read back on demand)."""

    path: Path
    rows: dict[str, tuple[int, int]]
    sha256: str
    #: For inputs other than one plain JSONL file: their pin (:meth:`PromptSource.identity`), and the
    #: temporary JSONL copy of their rows that ``path`` then points to (kept alive with the index).
    identity: dict[str, Any] | None = None
    spool: Any = None

    def matches(self, pinned: dict[str, Any]) -> bool:
        """Whether this is the input the plan pinned (its path may have moved)."""
        if self.identity is None:
            return self.sha256 == pinned.get("sha256")
        return {k: v for k, v in self.identity.items() if k != "path"} == {
            k: v for k, v in pinned.items() if k != "path"
        }

    def read(self, keys: set[str]) -> dict[str, PromptRow | str]:
        """The rows of ``keys`` (read in file order), or the reason a row no longer parses; keys the file lacks are
        left out."""
        out: dict[str, PromptRow | str] = {}
        name = str(self.path)
        with self.path.open("rb") as handle:
            for (offset, line), key in sorted((self.rows[k], k) for k in keys if k in self.rows):
                handle.seek(offset)
                try:
                    out[key] = parse_row(handle.readline(), name, line)
                except BadInputError as exc:
                    out[key] = f"{name}:{line}: {exc.detail}"
        return out

    def close(self) -> None:
        """Removes the temporary copy, if there is one."""
        if self.spool is not None:
            self.spool.cleanup()
            self.spool = None

    @classmethod
    def build(cls, path: Path, columns: Columns | None = None) -> PromptIndex:
        """Streams the file once; the first row of a key wins, as in a run; bad rows are left out.

        Compressed JSONL, Parquet and datasets cannot be read back at an offset: their rows are copied into
        a temporary JSONL file first (one pass), which is then indexed like a plain file."""
        source = open_source(path, columns or Columns())
        if source.kind != "jsonl" or source.files != (path,):
            spool = tempfile.TemporaryDirectory(prefix="eagle-datagen-verify-")
            copy = Path(spool.name) / "rows.jsonl"
            with copy.open("wb") as out:
                for _, _, raw in source.rows():
                    out.write(raw.rstrip(b"\n") + b"\n")
            index = cls.build(copy)
            return cls(copy, index.rows, index.sha256, identity=source.identity(), spool=spool)
        rows: dict[str, tuple[int, int]] = {}
        digest = hashlib.sha256()
        offset = 0
        with path.open("rb") as handle:
            for line, raw in enumerate(handle, start=1):
                digest.update(raw)
                if raw.strip():
                    with contextlib.suppress(BadInputError):
                        rows.setdefault(parse_row(raw, str(path), line).key, (offset, line))
                offset += len(raw)
        return cls(path, rows, digest.hexdigest())


class Rerenderer:
    """Compares stored ``prompt_ids`` with fresh renders in batches: each key rendered once, its row read in
    file order, the batch rendered by :meth:`Renderer.render_many` (one tokenizer call per batch)."""

    def __init__(self, renderer: RowRenderer, index: PromptIndex, on_error: ErrorSink) -> None:
        self.renderer = renderer
        self.index = index
        self.on_error = on_error
        self.pending: list[tuple[str, int, str, str, list[int]]] = []
        self.cache: dict[str, list[int] | str] = {}

    def add(
        self, path: str, line: int, rid: str, key: str, prompt_ids: list[int], kwargs: dict[str, Any] | None = None
    ) -> None:
        """``kwargs``: the record's own chat-template kwargs (a mix's variant), rendered with instead of the run's."""
        if kwargs:  # cached per (key, kwargs): each variant of a row renders once
            key = f"{key}\0{orjson.dumps(kwargs, option=orjson.OPT_SORT_KEYS).decode()}"
        self.pending.append((path, line, rid, key, prompt_ids))
        if len(self.pending) >= RENDER_BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self._render({key for *_, key, _ in self.pending} - self.cache.keys())
        for path, line, rid, key, prompt_ids in self.pending:
            self._compare(path, line, rid, key, prompt_ids)
        self.pending.clear()
        if len(self.cache) > RENDER_CACHE:
            self.cache.clear()

    def _render(self, keys: set[str]) -> None:
        found = self.index.read({k.partition("\0")[0] for k in keys})
        name = str(self.index.path)
        rows: list[tuple[str, PromptRow]] = []
        for key in sorted(keys):  # each (key, kwargs): the row, with the record's own kwargs over the run's
            row = found.get(key.partition("\0")[0])
            if isinstance(row, str):
                self.cache[key] = row
            elif row is not None:
                kwargs = key.partition("\0")[2]
                rows.append((key, dataclasses.replace(row, template_kwargs=orjson.loads(kwargs)) if kwargs else row))
        if not rows:
            return
        rendered = self.renderer.render_many([row for _, row in rows], name)
        for (key, row), ids in zip(rows, rendered, strict=True):
            self.cache[key] = f"{name}:{row.line}: {ids.detail}" if isinstance(ids, BadInputError) else ids

    def _compare(self, path: str, line: int, rid: str, cache_key: str, prompt_ids: list[int]) -> None:
        key = cache_key.partition("\0")[0]
        where = self.index.rows.get(key)
        if where is None:
            self.on_error("prompt_row_missing", path, line, rid, f"no row with key {key!r} in {self.index.path}")
            return
        rendered = self.cache[cache_key]
        if isinstance(rendered, str):
            self.on_error("render_error", path, line, rid, rendered)
        elif rendered != prompt_ids:
            at = first_difference(prompt_ids, rendered)
            self.on_error(
                "prompt_mismatch",
                path,
                line,
                rid,
                f"prompt_ids differ from a fresh render of {self.index.path}:{where[1]} at position {at} "
                f"({len(prompt_ids)} ids stored, {len(rendered)} rendered)",
            )


@dataclass
class RunContext:
    """What a group of shards is checked against: its manifest's plan and facts, or a tokenizer's facts."""

    label: str
    manifest: Manifest | None = None
    vocab_size: int | None = None
    stop_ids: frozenset[int] | None = None
    max_new_tokens: int | None = None
    samples_per_prompt: int | None = None
    stop_strings: bool = False
    family: Family | None = None
    rerender: Rerenderer | None = None
    #: ``--turns all`` runs: each turn against its row and the turn before it (verify/turns.py)
    turns: TurnChecker | None = None

    def spec(self) -> RecordSpec:
        """What each record is checked against: the same :class:`RecordSpec` the client used."""
        return RecordSpec(self.vocab_size, self.stop_ids, self.stop_strings, self.family)


@dataclass(frozen=True)
class ShardTarget:
    path: Path
    context: RunContext
    explicit: bool
    partial: bool
    recorded: ShardInfo | None


@dataclass
class Options:
    prompts: Path | None
    tokenizer: Path | None
    trust_remote_code: bool
    rerender: bool
    #: ``--server-url``: every prompt is also rendered through the server's /v1/tokenize (server/parity.py).
    server_url: str | None = None


class Setup:
    """Resolves paths into shard targets and builds one :class:`RunContext` per run (tokenizers loaded once)."""

    def __init__(self, options: Options, report: Report) -> None:
        self.options = options
        self.report = report
        self.contexts: dict[Path | None, RunContext] = {}
        self.tokenizers: dict[Path, Any] = {}
        self.indexes: dict[Path, PromptIndex] = {}
        self.scanned: set[Path] = set()
        self.servers: list[Any] = []  # ServerRenderer, closed at the end
        self.parity: list[Any] = []  # ParityRenderer, whose refusals become a warning

    def targets(self, paths: Sequence[Path]) -> list[ShardTarget]:
        found: dict[Path, ShardTarget] = {}
        for path in paths:
            for target in self._expand(path):
                known = found.get(target.path.resolve())
                if known is None or (target.explicit and not known.explicit):
                    found[target.path.resolve()] = target
        return list(found.values())

    def _expand(self, path: Path) -> Iterator[ShardTarget]:
        if path.is_dir():
            run_dir = path if (path / MANIFEST_NAME).is_file() else None
            if run_dir is None and path.name == SHARDS_DIR and (path.parent / MANIFEST_NAME).is_file():
                run_dir = path.parent
            shard_dir = run_dir / SHARDS_DIR if run_dir is not None else path
            files = _shard_files(shard_dir)
            if run_dir is None and not files:
                raise UsageError(
                    f"{path} is neither a run directory (no {MANIFEST_NAME}) nor a folder of shard_*.jsonl files; "
                    "give a run directory or shard files"
                )
            context = self.context(run_dir)
            if context.manifest is not None and shard_dir.resolve() not in self.scanned:
                self.scanned.add(shard_dir.resolve())
                self._missing_shards(context.manifest, shard_dir, files)
            for file in files:
                yield self._target(file, context, explicit=False)
            return
        run_dir = path.parent.parent if path.parent.name == SHARDS_DIR else None
        if run_dir is not None and not (run_dir / MANIFEST_NAME).is_file():
            run_dir = None
        yield self._target(path, self.context(run_dir), explicit=True)

    def _target(self, path: Path, context: RunContext, *, explicit: bool) -> ShardTarget:
        partial = path.name.endswith(".partial")
        recorded = None
        if context.manifest is not None and not partial:
            recorded = context.manifest.shard_map().get(path.name)
        return ShardTarget(path, context, explicit, partial, recorded)

    def _missing_shards(self, manifest: Manifest, shard_dir: Path, files: list[Path]) -> None:
        present = {f.name for f in files}
        for info in manifest.shards:
            if info.name not in present:
                self.report.add(
                    "error",
                    Finding(
                        "shard_missing",
                        str(shard_dir / info.name),
                        None,
                        None,
                        f"the manifest lists {info.name} ({info.records:,} records) but the file is not there",
                    ),
                )
        recorded = {info.name for info in manifest.shards}
        for file in files:
            if not file.name.endswith(".partial") and file.name not in recorded:
                self.report.add(
                    "warning",
                    Finding(
                        "shard_unrecorded",
                        str(file),
                        None,
                        None,
                        "a finalized shard the manifest does not list (a crash right after finalize; "
                        "`eagle-datagen resume` records it); its count and sha256 are not checked",
                    ),
                )

    # --- contexts ------------------------------------------------------------------------------

    def context(self, run_dir: Path | None) -> RunContext:
        key = run_dir.resolve() if run_dir is not None else None
        if key not in self.contexts:
            self.contexts[key] = self._manifest_context(run_dir) if run_dir is not None else self._bare_context()
        return self.contexts[key]

    def _manifest_context(self, run_dir: Path) -> RunContext:
        manifest = Manifest.load(run_dir)
        plan, facts = manifest.plan, manifest.facts
        sampling = plan.get("sampling_params") or {}
        stops = {*_ints(facts.get("eos_token_ids")), *_ints(facts.get("stop_token_ids"))}
        stops |= set(_ints(sampling.get("stop_token_ids")))
        kwargs = plan.get("chat_template_kwargs") or {}
        context = RunContext(
            label=str(run_dir),
            manifest=manifest,
            vocab_size=_int_or_none(facts.get("model_vocab_size")) or _int_or_none(facts.get("vocab_size")),
            stop_ids=frozenset(stops) if stops else None,
            max_new_tokens=_int_or_none(sampling.get("max_new_tokens")),
            samples_per_prompt=_int_or_none(plan.get("samples_per_prompt")),
            stop_strings=bool(sampling.get("stop") or sampling.get("stop_regex")),
            family=_manifest_family(facts.get("family")),
        )
        if (context.vocab_size is None or context.stop_ids is None) and self.options.tokenizer is not None:
            self._fill_from_tokenizer(context, self.options.tokenizer)
        if context.family is None:
            tokenizer = self.options.tokenizer or _plan_path(plan, "tokenizer")
            if tokenizer is not None and tokenizer.exists():
                context.family = self._detect(tokenizer, kwargs, context.stop_ids)
        self._setup_rerender(context, run_dir)
        self._note_gaps(context)
        return context

    def _bare_context(self) -> RunContext:
        context = RunContext(label="shard files without a manifest")
        what = "shard files without a manifest"
        self.report.skip(
            f"{what}: shard counts and sha256, id/key/sample agreement, the length finish (max_new_tokens) "
            "and the template kwargs (they live in the run's manifest.json)"
        )
        if self.options.tokenizer is not None:
            self._fill_from_tokenizer(context, self.options.tokenizer)
        if self.options.prompts is not None and self.options.rerender:
            self.report.skip(f"{what}: prompt re-render (it needs the run's template kwargs and samples per prompt)")
        self._note_gaps(context)
        return context

    def _fill_from_tokenizer(self, context: RunContext, path: Path) -> None:
        facts = tokenizer_facts(self._tokenizer(path), path)
        context.vocab_size = context.vocab_size or model_vocab_size(path) or facts.vocab_size
        context.stop_ids = context.stop_ids or frozenset(facts.eos_token_ids) or None
        if context.manifest is None:
            context.family = self._detect(path, {}, context.stop_ids)
            self.report.skip(
                f"{context.label}: the family structure under the run's chat_template_kwargs (checked as the "
                "template renders without kwargs)"
            )

    def _detect(self, path: Path, kwargs: dict[str, Any], stop_ids: frozenset[int] | None) -> Family | None:
        try:
            return detect_family(self._tokenizer(path), kwargs, stop_ids=sorted(stop_ids or ()))
        except Exception as exc:  # a template that cannot render the reference conversation
            self.report.skip(f"{path}: the family structure (the chat template did not render: {exc})")
            return None

    def _note_gaps(self, context: RunContext) -> None:
        label = context.label
        if context.vocab_size is None:
            self.report.skip(f"{label}: the vocabulary bound (only ids < 0 are caught); pass --tokenizer")
        if context.stop_ids is None:
            self.report.skip(
                f"{label}: that a 'stop' finish ends on a stop id (only agreement with 'matched'); pass --tokenizer"
            )
        if context.family is None:
            self.report.skip(f"{label}: the family structure (reasoning, harmony channels); pass --tokenizer")

    def _tokenizer(self, path: Path) -> Any:
        key = path.resolve()
        if key not in self.tokenizers:
            self.tokenizers[key] = load_tokenizer(path, trust_remote_code=self.options.trust_remote_code)
        return self.tokenizers[key]

    def _setup_rerender(self, context: RunContext, run_dir: Path) -> None:
        if not self.options.rerender:
            self.report.skip(f"{run_dir}: prompt re-render (turned off)")
            return
        plan = context.manifest.plan if context.manifest is not None else {}
        prompts = self.options.prompts or _plan_path(plan, "prompts")
        tokenizer = self.options.tokenizer or _plan_path(plan, "tokenizer")
        if prompts is None or not prompts.exists():
            self.report.skip(f"{run_dir}: prompt re-render (the prompts file {prompts} is not here; pass --prompts)")
            return
        if tokenizer is None or not tokenizer.exists():
            self.report.skip(f"{run_dir}: prompt re-render (the tokenizer {tokenizer} is not here; pass --tokenizer)")
            return
        if tokenizer_fingerprint(tokenizer) != (plan.get("tokenizer") or {}).get("fingerprint"):
            self._warn_changed("tokenizer_changed", tokenizer, "the tokenizer files differ from the ones")
        key = prompts.resolve()
        if key not in self.indexes:
            self.indexes[key] = PromptIndex.build(prompts, Columns(**(plan.get("prompts") or {}).get("columns", {})))
        index = self.indexes[key]
        if not index.matches(plan.get("prompts") or {}):
            self._warn_changed("prompts_changed", prompts, "the prompts file differs from the one")
        renderer = renderer_for_plan(self._tokenizer(tokenizer), plan)  # the run's kwargs and pinned date
        row_renderer = self._server_hook(renderer, plan, run_dir)
        context.rerender = Rerenderer(row_renderer, index, self._render_error)
        turns = plan.get("turns")
        if isinstance(turns, dict):
            reply_check = None
            if self.options.server_url is not None:  # the replies parsed again by that server's parsers
                reply_check = ReplyCheck(
                    self.options.server_url, turns, renderer.tokenizer, context.family, sorted(context.stop_ids or ()),
                    os.environ.get("EAGLE_DATAGEN_API_KEY") or None,
                )  # fmt: skip
            else:
                self.report.skip(f"{run_dir}: that each turn's reply is what the parsers make of it; pass --server-url")
            context.turns = TurnChecker(
                row_renderer,
                index,
                on_truncated=str(turns.get("on_truncated_turn") or "stop"),
                error=self._render_error,
                warn=self._warning,
                reply_check=reply_check,
            )

    def _server_hook(self, renderer: Renderer, plan: dict[str, Any], run_dir: Path) -> RowRenderer:
        """With ``--server-url``, the server renders every prompt too (:class:`ParityRenderer`); prompts a run
        rendered through the server (``--render server``) are compared with the server's render alone."""
        by_server = (plan.get("render") or {}).get("renderer") == "server"
        if self.options.server_url is None:
            if by_server:
                self.report.skip(
                    f"{run_dir}: prompt re-render against the server (the run rendered through /v1/tokenize, "
                    "--render server); pass --server-url to re-render there"
                )
            return renderer
        from eagle_datagen.generate.connect import ssl_context
        from eagle_datagen.server.parity import ParityRenderer
        from eagle_datagen.server.tokenize import ServerRenderer

        server = ServerRenderer(
            self.options.server_url, api_key=os.environ.get("EAGLE_DATAGEN_API_KEY") or None,
            template_kwargs=renderer.template_kwargs, tls=ssl_context(),
        )  # fmt: skip
        self.servers.append(server)
        if by_server:
            return server
        parity = ParityRenderer(renderer, server)
        self.parity.append(parity)
        return parity

    def _warn_changed(self, kind: str, path: Path, differs: str) -> None:
        message = f"{differs} pinned in the manifest; prompt mismatches may come from that"
        self.report.add("warning", Finding(kind, str(path), None, None, message))

    def _render_error(self, kind: str, path: str, line: int, rid: str, message: str) -> None:
        self.report.add("error", Finding(kind, path, line, rid, message))

    def _warning(self, kind: str, path: str, line: int, rid: str, message: str) -> None:
        self.report.add("warning", Finding(kind, path, line, rid, message))


def _shard_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), bool(m.group(2)), p) for p in directory.iterdir() if (m := SHARD_RE.match(p.name))]
    return [p for *_, p in sorted(found)]


def _plan_path(plan: dict[str, Any], name: str) -> Path | None:
    value = (plan.get(name) or {}).get("path")
    return Path(value) if isinstance(value, str) else None


def _ints(value: Any) -> list[int]:
    return [v for v in value if _int_or_none(v) is not None] if isinstance(value, list) else []


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _manifest_family(value: Any) -> Family | None:
    if not isinstance(value, dict):
        return None
    try:
        return Family.from_json(value)
    except (KeyError, TypeError, ValueError):
        return None


# --- per-record checks ------------------------------------------------------------------------------


class Checker:
    """Streams shards and checks each record; the hot path touches ids only through C-level builtins."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.seen: dict[str, int] = {}
        self.files: list[str] = []
        self.path = ""
        self.context = RunContext(label="")
        self.spec = RecordSpec()

    def check(self, target: ShardTarget) -> None:
        self.path = str(target.path)
        self.context = target.context
        self.spec = target.context.spec()
        self.files.append(self.path)
        state: ShardState = "in_progress" if target.partial and not target.explicit else "finalized"
        result = ShardResult(self.path, "partial" if target.partial and target.explicit else state)
        digest = hashlib.sha256() if target.recorded is not None else None
        line = 0
        with target.path.open("rb", buffering=READ_BUFFER) as handle:
            for raw in handle:
                if digest is not None:
                    digest.update(raw)
                if raw[-1] != _NEWLINE:
                    self._torn(raw, line + 1, live=state == "in_progress")
                    break
                line += 1
                self.record(raw, line)
            result.bytes = handle.tell()
        result.records = line
        if target.recorded is not None and digest is not None:
            self._compare_recorded(result, target.recorded, digest.hexdigest())
        if self.context.rerender is not None:
            self.context.rerender.flush()
        if self.context.turns is not None:
            self.context.turns.flush()
        self.report.shards.append(result)
        self.report.records += line
        self.report.bytes += result.bytes

    def _torn(self, raw: bytes, line: int, *, live: bool) -> None:
        message = f"the last line is cut off after {len(raw):,} bytes (no newline)"
        if live:
            message += "; normal while a run is writing or after a kill: resume drops it and sends it again"
        self.report.add("warning" if live else "error", Finding("torn_line", self.path, line, record_id(raw), message))

    def _compare_recorded(self, result: ShardResult, info: ShardInfo, sha256: str) -> None:
        result.manifest_records = info.records
        result.checksum = "ok" if sha256 == info.sha256 else "mismatch"
        if result.records != info.records:
            self.error("shard_count", None, None, f"{result.records:,} records but the manifest says {info.records:,}")
        if result.checksum == "mismatch":
            self.error(
                "shard_checksum",
                None,
                None,
                f"sha256 {sha256[:16]}... differs from {info.sha256[:16]}... recorded at finalize: "
                "the file changed after it was written",
            )

    def error(self, kind: str, line: int | None, rid: str | None, message: str) -> None:
        self.report.add("error", Finding(kind, self.path, line, rid, message))

    def warn(self, kind: str, line: int | None, rid: str | None, message: str) -> None:
        self.report.add("warning", Finding(kind, self.path, line, rid, message))

    def record(self, raw: bytes, line: int) -> None:
        """Every check on one record line (ending in a newline)."""
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self.error("parse", line, record_id(raw), f"not valid JSON: {exc}")
            return
        if type(record) is not dict:
            self.error("schema", line, None, f"the line is a JSON {type(record).__name__}, not a record object")
            return
        rid = record.get("id")
        key = record.get("key")
        sample = record.get("sample")
        prompt = record.get("prompt_ids")
        output = record.get("output_ids")
        finish = record.get("finish_reason")
        completion = record.get("completion_tokens")
        if not (
            type(rid) is str
            and type(key) is str
            and type(sample) is int
            and type(prompt) is list
            and type(output) is list
            and type(finish) is dict
            and type(completion) is int
        ):
            self.error("schema", line, rid if isinstance(rid, str) else None, _schema_message(record))
            return
        turn = record.get("turn")
        self._identity(rid, key, sample, line, turn if type(turn) is int else None)
        if not output:
            self.error("empty_output", line, rid, "output_ids is empty")
            return
        if not prompt:
            self.error("schema", line, rid, "prompt_ids is empty")
            return
        compact = _compact_int_lists(raw, prompt, output)
        if compact is None:
            problem = _exact_types_problem(prompt, output)
            if problem is not None:
                self.error(problem[0], line, rid, problem[1])
                return
        verdict = check_record(
            self.spec, prompt, output, finish, completion, max_new_tokens=self.context.max_new_tokens,
            compact_output=compact or None,
        )  # fmt: skip
        for kind, message in verdict.errors:
            self.error(kind, line, rid, message)
        for kind, message in verdict.warnings:
            self.warn(kind, line, rid, message)
        if "turn" in record:  # --turns all: rendered from its own messages, checked against its row and turns
            if self.context.turns is not None:
                self.context.turns.add(self.path, line, rid, key, record)
        elif self.context.rerender is not None:
            kwargs = record.get("chat_template_kwargs")  # a mix: the record's own variant
            self.context.rerender.add(self.path, line, rid, key, prompt, kwargs if type(kwargs) is dict else None)

    def _identity(self, rid: str, key: str, sample: int, line: int, turn: int | None = None) -> None:
        first = self.seen.get(rid)
        if first is None:
            self.seen[rid] = (len(self.files) - 1) << 32 | line  # (file, line) of the first use, packed
        else:
            self.error("duplicate_id", line, rid, f"id already used on {self.files[first >> 32]}:{first & 0xFFFFFFFF}")
        spp = self.context.samples_per_prompt
        if spp is not None and (sample != 0 or rid != key or spp != 1 or turn is not None):
            problem = _id_key_problem(rid, key, sample, spp, turn)
            if problem is not None:
                self.error("id_mismatch", line, rid, problem)

    def settle(self, contexts: Sequence[RunContext]) -> None:
        """Run-wide work left at the end: the last re-render batches."""
        for context in contexts:
            if context.rerender is not None:
                context.rerender.flush()
            if context.turns is not None:
                context.turns.settle()


def _compact_int_lists(raw: bytes, prompt: list[Any], output: list[Any]) -> bytes | None:
    """The output ids' text when both lists are non-negative ints, proven on the writer's compact layout in ``raw``
    (``b""`` when that text holds whitespace: proven, but not the digits-and-commas text the record check's fast
    path searches).

    The text between each list's brackets holds nothing but digits, commas and whitespace (``bytes.translate``
    deletes those in C; anything left is a sign, a float, a literal, a string or a nested value), its commas
    number one less than the parsed list's length, and it ends with the parsed list's last id (a guard against a
    look-alike key elsewhere in the line). ``None`` sends the record to :func:`_exact_types_problem`."""
    start = raw.find(_PROMPT_KEY)
    if start < 0 or not prompt or not output:
        return None
    start += len(_PROMPT_KEY)
    prompt_end = raw.find(b"]", start)
    if prompt_end < 0 or not raw.startswith(_BETWEEN_LISTS, prompt_end):
        return None
    out_start = prompt_end + len(_BETWEEN_LISTS)
    end = raw.find(b"]", out_start)
    if end < 0:
        return None
    text, spaced = b"", False
    for lo, hi, ids in ((start, prompt_end, prompt), (out_start, end, output)):
        text = raw[lo:hi]
        if text.translate(None, _DIGITS_COMMAS):  # not the writer's own layout: whitespace is still a proof
            spaced = True
            if text.translate(None, _ID_LIST_BYTES):
                return None
        if text.count(b",") != len(ids) - 1:
            return None
        last = ids[-1]
        if type(last) is not int or not text.rstrip().endswith(b"%d" % last):
            return None
    return b"" if spaced else text


def _exact_types_problem(prompt: list[Any], output: list[Any]) -> Problem | None:
    """Every id an int (records off the fast path, and to name the culprit); the range is the record check's."""
    for name, ids in (("prompt_ids", prompt), ("output_ids", output)):
        bad = next((i for i, x in enumerate(ids) if type(x) is not int), None)
        if bad is not None:
            return ("schema", f"{name}[{bad}] is {ids[bad]!r}, not an integer id")
    return None


def _id_key_problem(rid: str, key: str, sample: int, samples_per_prompt: int, turn: int | None = None) -> str | None:
    from eagle_datagen.generate.pipeline import record_ids

    if not 0 <= sample < samples_per_prompt:
        return f"sample {sample} is outside [0, {samples_per_prompt}) (samples per prompt in the manifest)"
    expected = record_ids(key, samples_per_prompt)[sample][0]
    if turn is not None:
        expected = turn_id(expected, turn)
    if rid != expected:
        what = f"key {key!r}, sample {sample}" + (f" and turn {turn}" if turn is not None else "")
        return f"the id does not follow from {what} (expected {expected!r})"
    return None


def _schema_message(record: dict[str, Any]) -> str:
    for name, kind in _FIELDS:
        if name not in record:
            return f"the record has no {name!r}"
        value = record[name]
        if type(value) is not kind:
            return f"{name!r} is {type(value).__name__}, not {kind.__name__}"
    return "the record does not have the expected fields"


# --- entry points -----------------------------------------------------------------------------------


def verify(
    paths: Sequence[Path],
    *,
    prompts: Path | None = None,
    tokenizer: Path | None = None,
    trust_remote_code: bool = False,
    max_errors: int = 20,
    rerender: bool = True,
    server_url: str | None = None,
) -> Report:
    """Checks every record of the given shard files and run directories; see the module docstring."""
    started = time.perf_counter()
    report = Report(max_examples=max_errors)
    setup = Setup(Options(prompts, tokenizer, trust_remote_code, rerender, server_url), report)
    targets = setup.targets(paths)
    if not targets:
        report.skip(f"everything: no shard files under {', '.join(map(str, paths))}")
    checker = Checker(report)
    try:
        for target in targets:
            try:
                checker.check(target)
            except OSError as exc:
                raise UsageError(f"cannot read {target.path}: {exc.strerror or exc}") from exc
        checker.settle(list(setup.contexts.values()))
        for parity in setup.parity:
            if parity.refused:
                line, message = parity.refused[0]
                report.add("warning", Finding(
                    "server_refused", str(server_url), line, None,
                    f"{parity.server.url}'s chat path refuses {len(parity.refused)} prompt(s) the template renders "
                    f"(e.g. line {line}: {message}); served traffic could not send them",
                ), count=len(parity.refused))  # fmt: skip
    finally:
        for index in setup.indexes.values():
            index.close()
        for server in setup.servers:
            server.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def verify_command(
    paths: list[Path],
    *,
    prompts: Path | None,
    tokenizer: Path | None,
    trust_remote_code: bool,
    as_json: bool,
    max_errors: int,
    server_url: str | None = None,
) -> int:
    """``eagle-datagen verify-shard``: prints the report; 0 when there are no errors, else 1."""
    report = verify(
        paths, prompts=prompts, tokenizer=tokenizer, trust_remote_code=trust_remote_code, max_errors=max_errors,
        server_url=server_url,
    )  # fmt: skip
    if as_json:
        print(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_report(report))
    return 0 if report.ok else 1
