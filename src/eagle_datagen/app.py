"""``run`` and ``resume``: wire the stages together, own the servers, and report.

The CLI builds an options dict and calls :func:`run_command` or :func:`resume_command`; everything
that needs a test lives here or below, not in the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import os
import shlex
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle_datagen import __version__
from eagle_datagen.config import RunConfig
from eagle_datagen.errors import BadInputError, DatagenError, InternalError, UsageError
from eagle_datagen.generate.client import auth_headers, make_http_client
from eagle_datagen.generate.connect import refuse_proxies, ssl_context
from eagle_datagen.generate.limits import Limits
from eagle_datagen.generate.pipeline import Pipeline, Producer, Stats, record_ids
from eagle_datagen.generate.pool import Endpoint, ServerPool
from eagle_datagen.generate.transport import Transport
from eagle_datagen.generate.turns import TurnDriver, TurnState
from eagle_datagen.inputs.mix import describe_mix, record_plan
from eagle_datagen.inputs.prompts import PromptReader
from eagle_datagen.inputs.render import (
    Renderer,
    RenderPool,
    TokenizerFacts,
    count_rows_with_tools,
    load_tokenizer,
    model_vocab_size,
    render_plan,
    template_notes,
    tokenizer_facts,
)
from eagle_datagen.inputs.sources import open_source
from eagle_datagen.options import build_run_config, merge, savable
from eagle_datagen.progress import Progress, format_failures, format_summary
from eagle_datagen.record.checks import RecordSpec
from eagle_datagen.record.family import Family, PresetMismatch, apply_preset_tokens, describe_family, detect_family
from eagle_datagen.server.facts import (
    FactsCheck,
    ServerFacts,
    default_concurrency,
    model_mismatch_warnings,
    read_server_facts,
    resumed_model_warnings,
)
from eagle_datagen.server.launcher import ManagedServer, redact
from eagle_datagen.server.parity import preflight_parity
from eagle_datagen.server.recovery import exited, make_recover
from eagle_datagen.server.router import ManagedRouter, check_router_passes
from eagle_datagen.server.tokenize import ServerRenderer
from eagle_datagen.store.lock import LOCK_NAME, check_not_in_use, hold
from eagle_datagen.store.logs import ENDS_NAME, FAILURES_NAME, REJECTS_NAME, JsonlLog, read_entries
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest, check_plan
from eagle_datagen.store.shards import ShardStore, read_records

log = logging.getLogger("eagle_datagen")

#: How long an attached server may stay unreachable before the run gives up (resume continues it).
OUTAGE_GIVE_UP_S = 3600.0
SHARDS_DIR = "shards"


#: Exit codes of ``run`` and ``resume`` (README, "Exit codes"). Misuse (2) comes from :class:`UsageError`,
#: :class:`ManifestMismatch` and :class:`BadInputError`; a runtime failure (1) from any other error.
EXIT_DONE = 0
EXIT_FAILURE = 1
EXIT_FAILED_REQUESTS = 3
EXIT_INTERRUPTED = 130
#: Server options: one given to ``resume`` replaces the saved server choice as a whole.
SERVER_CHOICE = ("server_url", "model")


@dataclass
class Outcome:
    """How a run ended, for the exit code and the last lines printed."""

    summary: str
    interrupted: bool
    out_dir: Path
    exit_code: int = EXIT_DONE


@dataclass(frozen=True)
class PromptScan:
    """The whole prompts file, read and validated before anything is sent (no row is kept)."""

    rows: int
    bad: int
    #: Records still to generate (rows × samples, less those already done or kept aside).
    todo: int


def echo(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resume_hint(out_dir: Path) -> str:
    """The command that continues the run in ``out_dir``, as the user can paste it."""
    return f"eagle-datagen resume --out {shlex.quote(str(out_dir))}"


def run_command(options: dict[str, Any]) -> Outcome:
    """``eagle-datagen run``: a new output directory.

    The prompts file is validated before anything is written (the directory stays empty), so after a
    bad row the same command (with the row fixed, or with ``--skip-bad-lines``) works as it is."""
    # The date a date-dependent template renders is pinned at run (saved with the options for resume).
    options = {"render_date": datetime.date.today().isoformat(), **{k: v for k, v in options.items() if v is not None}}
    config = build_run_config(options)
    check_not_in_use(config.out_dir)  # a live writer is named, not reported as "not empty"
    prepare_new_out_dir(config.out_dir)
    with hold(config.out_dir, "eagle-datagen run"):  # one writer per directory, for the whole run
        prepare_new_out_dir(config.out_dir)  # still unused, now that nobody else can write there
        scan = scan_prompts(config, frozenset())
        return _run_until_stopped(_execute(config, options, resume=False, scan=scan), config.out_dir)


def resume_command(out_dir: Path, options: dict[str, Any]) -> Outcome:
    """``eagle-datagen resume``: the manifest's options, overridden by explicit ones.

    A server choice given now (``--model`` or ``--server-url``) replaces the saved one: ``--model``
    alone drops the saved ``--server-url`` list, so the server is launched here."""
    with hold(out_dir, "eagle-datagen resume"):  # one writer per directory, for the whole resume
        return _resume(out_dir, options)


def _resume(out_dir: Path, options: dict[str, Any]) -> Outcome:
    if out_dir.is_dir() and not any(p.name != ".lock" for p in out_dir.iterdir()):
        raise UsageError(
            f"{out_dir} is empty: no run got as far as writing there (a run stopped by a bad prompt row or a "
            f"bad option leaves it so); start it with `eagle-datagen run` and --out {shlex.quote(str(out_dir))}"
        )
    manifest = Manifest.load(out_dir)
    saved = dict(manifest.server.get("options", {}))
    if "model" in options and "server_url" not in options and saved.pop("server_url", None):
        echo("  --model given: it replaces the saved --server-url (a server is launched here if work is left)")
    effective = merge(saved, options)
    config = build_run_config(merge(effective, {"out": out_dir}))
    return _run_until_stopped(_execute(config, effective, resume=True), out_dir)


def _run_until_stopped(job: Coroutine[Any, Any, Outcome], out_dir: Path) -> Outcome:
    """Runs ``job``; a second Ctrl-C (or one during start-up) cancels it, which is still a clean stop.

    A runtime error raised once the directory holds a manifest carries the command that continues."""
    try:
        return asyncio.run(job)
    except asyncio.CancelledError:
        return Outcome(summary="stopped at once; what was written is consistent", interrupted=True,
                       out_dir=out_dir, exit_code=EXIT_INTERRUPTED)  # fmt: skip
    except Exception as exc:
        raise _with_continue(exc, out_dir)  # noqa: B904 (an InternalError carries its __cause__)


def _with_continue(exc: BaseException, out_dir: Path) -> DatagenError:
    """The error to show: a :class:`DatagenError` as it is, anything else (a bug of ours) as one line
    (the CLI shows the traceback with -v); with the command that continues, once a manifest exists."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # a TaskGroup's wrapper: say what actually happened
    if isinstance(exc, DatagenError):
        error = exc
    else:
        error = InternalError(f"unexpected {type(exc).__name__}: {exc} (a bug; run with -v for the traceback)")
        error.__cause__ = exc
    if error.exit_code == EXIT_FAILURE and (out_dir / MANIFEST_NAME).is_file():
        error.continue_with = resume_hint(out_dir)
    return error


def scan_prompts(config: RunConfig, skip_ids: Collection[str], turns: TurnState | None = None) -> PromptScan:
    """Reads and validates every row before the first request (the file is read for its sha256
    anyway), so a bad row late in the file costs no work in flight. Rows are not kept: only their
    keys, as the run's own reader does. With ``--skip-bad-lines`` bad rows are counted here and set
    aside (rejects.jsonl) by the run. With ``--turns all`` the work left counts turns (at most: a
    conversation may end early)."""
    open_source(config.prompts, config.input_columns)  # the kind of input and its columns, before any row
    n = config.samples_per_prompt
    state = turns if turns is not None else TurnState() if config.turns is not None else None

    def is_done(key: str) -> bool:
        if state is not None:
            return all(state.is_done(base) for base, _ in record_ids(key, n))
        return all(rid in skip_ids for rid, _ in record_ids(key, n))

    reader = PromptReader(
        config.prompts,
        on_bad=(lambda exc: None) if config.skip_bad_lines else None,
        is_done=is_done if skip_ids else None,
        columns=config.input_columns,
        partition=config.partition,
        turns=state is not None,
    )
    todo = 0
    for row in reader:
        if state is not None:
            assert row.turn_plan is not None  # the reader splits rows when turns are on
            todo += sum(state.remaining(row.turn_plan, base) for base, _ in record_ids(row.key, n))
        else:
            todo += sum(1 for rid, _ in record_ids(row.key, n) if rid not in skip_ids)
    return PromptScan(rows=reader.stats.rows, bad=reader.stats.bad, todo=todo)


def bad_row_advice(exc: BadInputError, out_dir: Path) -> BadInputError:
    """A bad row found once ``out_dir`` holds the run: the prompts file is pinned by its sha256, so
    fixing the row cannot continue this run; setting it aside can."""
    return BadInputError(
        exc.path,
        exc.line,
        exc.kind,
        exc.detail,
        f"set such rows aside (rejects.jsonl) and continue: {resume_hint(out_dir)} --skip-bad-lines; "
        "or fix the row and start a new run with a new --out (the prompts file is pinned by its sha256)",
    )


def prepare_new_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is a file; give a directory")
    if out_dir.is_dir() and any(p.name != LOCK_NAME for p in out_dir.iterdir()):
        if (out_dir / MANIFEST_NAME).is_file():
            raise UsageError(
                f"--out {out_dir} is not empty. To continue the run there: {resume_hint(out_dir)}; "
                "to start afresh, give a new directory"
            )
        raise UsageError(f"--out {out_dir} is not empty and holds no eagle-datagen run; give a new or empty directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create --out {out_dir}: {exc.strerror}") from exc
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"--out {out_dir} is not writable")


def build_plan(
    config: RunConfig, facts: TokenizerFacts, prompts_identity: dict[str, Any], render: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything that changes the bytes of a record (``render``: :func:`render_plan`)."""
    return {
        "render": render or {"renderer": config.render, "date": None},
        "prompts": prompts_identity,
        "tokenizer": {
            "path": str(config.tokenizer.resolve()),
            "fingerprint": facts.fingerprint,
            "chat_template_sha256": facts.chat_template_sha256,
        },
        "chat_template_kwargs": config.chat_template_kwargs,
        "sampling_params": config.sampling.to_request(),
        "samples_per_prompt": config.samples_per_prompt,
        "shard_size": config.shard_size,
        **({"partition": config.partition.to_json()} if config.partition is not None else {}),
        **({"mix": config.mix.to_json()} if config.mix is not None else {}),
        **({"seed": config.seed} if config.seed is not None else {}),
        **({"turns": config.turns.to_json()} if config.turns is not None else {}),
    }


async def _execute(
    config: RunConfig, options: dict[str, Any], *, resume: bool, scan: PromptScan | None = None
) -> Outcome:
    out = config.out_dir
    source = open_source(config.prompts, config.input_columns)
    tokenizer = load_tokenizer(config.tokenizer, trust_remote_code=config.trust_remote_code)
    facts = tokenizer_facts(tokenizer, config.tokenizer)
    renderer = Renderer(tokenizer, config.chat_template_kwargs, render_date=config.render_date)
    identity = source.identity()
    plan = build_plan(config, facts, identity, render_plan(renderer, config.render))
    family = _family(tokenizer, config, facts, options)
    stop_ids = sorted({*facts.eos_token_ids, *family.stop_ids, *config.sampling.params.get("stop_token_ids", [])})
    if resume:
        manifest = Manifest.load(out)
        check_plan(manifest.plan, plan)
        manifest.plan = plan  # same bytes; paths may have moved
    else:
        manifest = Manifest(path=out / MANIFEST_NAME, plan=plan)
    manifest.facts = {
        "vocab_size": facts.vocab_size,
        "model_vocab_size": model_vocab_size(config.tokenizer),
        "eos_token_ids": list(facts.eos_token_ids),
        "stop_token_ids": stop_ids,
        "think_open_id": facts.think_open_id,
        "think_close_id": facts.think_close_id,
        "sampling_source": config.sampling.source,
        "sampling_origins": config.sampling.origins,
        "preset": config.preset,
        "family": family.to_json(),
    }
    spec = RecordSpec(
        vocab_size=manifest.facts["model_vocab_size"] or facts.vocab_size, stop_ids=frozenset(stop_ids), family=family
    )
    if config.turns is not None:
        check_turn_parsers(config, family, source)
    manifest.server["options"] = savable(options)
    manifest.save()

    echo(f"eagle-datagen {__version__}: {'resuming' if resume else 'writing'} {out}")
    echo(f"  sampling ({config.sampling.source}): {config.sampling.to_request()}")
    echo(f"  chat template kwargs: {config.chat_template_kwargs or '{}'}; stop ids: {stop_ids}")
    echo(f"  family: {describe_family(family)}")
    if config.mix is not None:
        echo(f"  mix (per {config.mix.per}, seed {config.mix.seed}): {describe_mix(config.mix)}")
    if config.samples_per_prompt > 1 and (greedy := greedy_samplings(config)):
        echo(
            f"  warning: --samples-per-prompt {config.samples_per_prompt} with greedy sampling ({greedy}): the "
            "samples of a prompt will be (nearly) identical; set --temperature > 0 (and --top-k other than 1) for "
            "distinct ones"
        )
    for note in template_notes(renderer, source):
        echo(f"  {note}")

    store = ShardStore(out / SHARDS_DIR, config.shard_size, manifest.add_shard)
    report = store.open(manifest.shard_map())
    for info in report.finalized:
        if info.name not in manifest.shard_map():
            manifest.add_shard(info)
    if report.truncated_bytes:
        echo(
            f"  repaired a torn tail: dropped {report.truncated_bytes} bytes ({report.truncated_lines} incomplete line(s)) "
            "from the partial shard; those requests are sent again"
        )
    if report.adopted or report.duplicates_dropped:
        echo(f"  adopted out-of-place partial shards ({', '.join(report.adopted)}); dropped "
             f"{report.duplicates_dropped} records other shards already hold")  # fmt: skip
    if resume:
        echo(f"  already done: {len(store.done)} records")

    failed_entries = [e for e in read_entries(out / FAILURES_NAME) if isinstance(e.get("id"), str)]
    failed_ids = {e["id"] for e in failed_entries}
    crashed_ids = {e["id"] for e in failed_entries if e.get("kind") == "server_crash"}  # retried alone
    if resume and failed_ids - store.done:
        verb = "retrying" if config.retry_failed else "keeping aside (--no-retry-failed)"
        echo(f"  {verb} {len(failed_ids - store.done)} failed requests")
    skip_ids = store.done if config.retry_failed else store.done | failed_ids
    turn_state: TurnState | None = None
    ends: JsonlLog | None = None
    if config.turns is not None:
        turn_state = TurnState.load(
            store.done,
            read_entries(out / ENDS_NAME),
            functools.partial(read_records, out / SHARDS_DIR),
            kept_aside=() if config.retry_failed else failed_ids,
        )
        ends = JsonlLog(out / ENDS_NAME)
        for entry in turn_state.found_ended():  # a stop came between a conversation's last record and its line
            ends.append(entry)
        if resume:
            going_on = sum(1 for b, k in turn_state.last_turn.items() if k and b not in turn_state.ended)
            echo(f"  conversations: {len(turn_state.ended)} ended, {going_on} to continue from their last turn")
        if lost := turn_state.unreadable():
            echo(
                f"  warning: {len(lost)} conversation(s) are not continued: their last turn record could not be read "
                f"back from the shards (e.g. {lost[0]!r}); check them with `eagle-datagen verify-shard {out}`"
            )
    if scan is None:
        try:
            scan = scan_prompts(config, skip_ids, turn_state)
        except BadInputError as exc:
            raise bad_row_advice(exc, out) from exc
    if resume and scan.todo == 0:
        return _nothing_to_do(store, out)
    failures = JsonlLog(out / FAILURES_NAME)
    rejects = JsonlLog(out / REJECTS_NAME, truncate=True)
    stats = Stats()
    started = time.time()
    run_entry: dict[str, Any] = {"command": "resume" if resume else "run", "started": _utc(started)}
    manifest.runs.append(run_entry)

    def on_bad(exc: BadInputError) -> None:
        rejects.append({"line": exc.line, "kind": exc.kind, "message": exc.detail})

    def is_done(key: str) -> bool:
        if turn_state is not None:
            return all(turn_state.is_done(base) for base, _ in record_ids(key, config.samples_per_prompt))
        return all(rid in skip_ids for rid, _ in record_ids(key, config.samples_per_prompt))

    reader = PromptReader(
        config.prompts,
        on_bad=on_bad if config.skip_bad_lines else None,
        is_done=is_done if skip_ids or turn_state is not None else None,
        columns=config.input_columns,
        partition=config.partition,
        turns=config.turns is not None,
    )
    interrupted = False
    stack = contextlib.ExitStack()
    switch = stack.enter_context(_signals(config.grace_period_s))
    try:
        async with _servers(config, out) as servers:
            http, pool, server_facts, managed = servers.http, servers.pool, servers.facts, servers.managed
            pool.crashes.preload(crashed_ids - store.done)
            if resume and store.done:
                for warning in resumed_model_warnings(manifest.server.get("facts"), server_facts[0]):
                    echo(f"  warning: {warning}")
            manifest.server.update(
                {"facts": [f.to_json() for f in server_facts], "sglang_version": server_facts[0].version}
            )
            if managed is not None:
                manifest.server["launch_command"] = redact(managed.command)
            run_entry["servers"] = [f.url for f in server_facts]
            manifest.save()
            for warning in model_mismatch_warnings(
                server_facts[0], config.tokenizer, facts.vocab_size, manifest.facts["model_vocab_size"]
            ):
                echo(f"  warning: {warning}")
            limits = Limits(
                max_input_len=_min([f.max_req_input_len for f in server_facts]),
                model_vocab=manifest.facts["model_vocab_size"],
            )
            concurrency = servers.concurrency
            echo(
                f"  servers: {', '.join(f.url for f in server_facts)}; SGLang {server_facts[0].version}; "
                f"concurrency {concurrency}"
                + ("" if config.concurrency else " (from the servers' max_running_requests)")
            )
            progress = Progress(stats, pool, total=scan.todo, enabled=config.progress)
            # The serving renderer lives on the servers themselves: an sglang-router does not serve /v1/tokenize
            # (it wants another body), so a router's workers render, each of which it checked.
            urls = [url for f in server_facts for url in (f.workers or (f.url,))]
            if config.render == "client" and config.render_parity_rows:
                await asyncio.to_thread(
                    preflight_parity, renderer, urls, source=source, rows=config.render_parity_rows,
                    api_key=config.server.api_key, echo=echo, tls=servers.transport.ssl_context,
                )  # fmt: skip
            if config.render == "server":
                server_renderer = ServerRenderer(
                    urls[0],
                    api_key=config.server.api_key,
                    template_kwargs=config.chat_template_kwargs,
                    tls=servers.transport.ssl_context,
                )
                stack.callback(server_renderer.close)
                echo(f"  rendering every prompt through {urls[0]}/v1/tokenize (--render server)")
                chunks: Any = server_renderer.render_chunks
            elif config.render_workers > 0:
                render_pool = RenderPool(
                    renderer,
                    config.tokenizer,
                    workers=config.render_workers,
                    trust_remote_code=config.trust_remote_code,
                )
                stack.callback(render_pool.close)
                chunks = render_pool.render_chunks
            else:
                chunks = renderer.render_chunks
            driver: TurnDriver | None = None
            if config.turns is not None:
                render_one: Any = server_renderer.tokenize if config.render == "server" else renderer.render
                driver = TurnDriver(
                    config.turns,
                    tokenizer=tokenizer,
                    family=family,
                    stop_ids=stop_ids,
                    render_one=functools.partial(render_one, path=str(config.prompts)),
                    http=servers.transport,
                    limits=limits,
                    parser_url={f.url: f.workers[0] for f in server_facts if f.workers},
                )
                await driver.check_parsers(urls[0])
                echo(
                    f"  turns: all (reasoning parser {config.turns.reasoning_parser or 'none'}, tool-call parser "
                    f"{config.turns.tool_call_parser or 'none'}, a truncated turn: {config.turns.on_truncated})"
                )
            producer = Producer(
                reader,
                functools.partial(chunks, path=str(config.prompts)),
                samples_per_prompt=config.samples_per_prompt,
                skip=skip_ids.__contains__,
                limits=limits,
                reject=rejects.append,
                stats=stats,
                mix=config.mix,
                record_plan=functools.partial(
                    record_plan, config.mix, config.seed, config.chat_template_kwargs, config.sampling.to_request()
                ),
                turns=turn_state,
                on_truncated=config.turns.on_truncated if config.turns is not None else "stop",
            )
            pipeline = Pipeline(
                producer=producer,
                pool=pool,
                http=http,
                transport=servers.transport,
                request_timeout_s=config.request_timeout_s,
                store=store,
                failures=failures,
                sampling_params=config.sampling.to_request(),
                spec=spec,
                concurrency=concurrency,
                max_retries=config.max_retries,
                checkpoint_records=config.checkpoint_records,
                checkpoint_interval_s=config.checkpoint_interval_s,
                stall_timeout_s=config.stall_timeout_s,
                preflight=config.server.preflight,
                stats=stats,
                on_progress=progress.update,
                turns=driver,
                ends=ends,
            )
            switch.pipeline = pipeline
            try:
                await pipeline.run(config.grace_period_s)
            except BadInputError as exc:  # a row the chat template rejects (the scan cannot render)
                raise bad_row_advice(exc, out) from exc
            finally:
                progress.close()
            interrupted = switch.stopped
            if not interrupted:
                store.finish()
    except BaseException:
        interrupted = True
        raise
    finally:
        stack.close()
        with contextlib.suppress(DatagenError):
            store.close()
        failures.close()
        rejects.close()
        if ends is not None:
            ends.close()
        run_entry.update(
            {
                "finished": _utc(time.time()),
                "records": stats.records,
                "failures": stats.failures,
                "interrupted": interrupted,
            }
        )
        with contextlib.suppress(DatagenError):
            manifest.save()
    unresolved = failed_requests(out, store.done)
    summary = format_summary(
        stats,
        reader.stats,
        store_total=len(store.done),
        out_dir=out,
        wall_s=time.time() - started,
        samples=config.samples_per_prompt,
        unresolved=unresolved,
        interrupted=interrupted,
    )
    code = EXIT_INTERRUPTED if interrupted else EXIT_FAILED_REQUESTS if unresolved else EXIT_DONE
    return Outcome(summary=summary, interrupted=interrupted, out_dir=out, exit_code=code)


def check_turn_parsers(config: RunConfig, family: Family, source: Any) -> None:
    """``--turns all`` splits each reply as serving does: a reasoning model needs its reasoning parser (else the
    history would carry the whole reasoning as the answer), and rows with tools need the tool-call parser."""
    assert config.turns is not None
    if family.has_think and not config.turns.reasoning_parser_given:
        raise UsageError(
            f"--turns all: the model reasons ({describe_family(family)}), so each reply must be split by SGLang's "
            "reasoning parser: give --reasoning-parser-name (kimi_k2, qwen3, deepseek-r1, glm45, ...), or set it in "
            "the preset's [parsers]; --reasoning-parser-name none keeps the whole reply as the answer"
        )
    if not config.turns.tool_call_parser_given and count_rows_with_tools(source):
        raise UsageError(
            f"--turns all: {config.prompts} has rows with tools, so each reply's tool calls must be parsed by SGLang's "
            "tool-call parser: give --tool-call-parser-name (kimi_k2, qwen25, deepseekv3, glm45, ...), or set it in "
            "the preset's [parsers]; --tool-call-parser-name none keeps calls as text"
        )


def is_greedy(params: Mapping[str, Any]) -> bool:
    """Sampling that gives one output per prompt: temperature 0, or top_k 1."""
    return params.get("temperature") == 0 or params.get("top_k") == 1


def greedy_samplings(config: RunConfig) -> str:
    """Which of the run's samplings are greedy ("" if none): the run's, or each mix variant's over it."""
    base = config.sampling.to_request()
    if config.mix is None:
        return "the run's" if is_greedy(base) else ""
    names = [v.name for v in config.mix.variants if is_greedy({**base, **v.sampling})]
    return f"mix variant(s) {', '.join(names)}" if names else ""


def failed_requests(out: Path, done: Collection[str]) -> Counter[str]:
    """Failure kinds of the records that failed and are not written (the last entry of each id)."""
    last: dict[str, str] = {}
    for entry in read_entries(out / FAILURES_NAME):
        rid = entry.get("id")
        if isinstance(rid, str) and rid not in done:
            last[rid] = str(entry.get("kind"))
    return Counter(last.values())


def _nothing_to_do(store: ShardStore, out: Path) -> Outcome:
    """A resume with no record left to generate: no server is started or needed."""
    try:
        store.finish()
    finally:
        store.close()
    unresolved = failed_requests(out, store.done)
    lines = [f"nothing to do: all {len(store.done)} records are in {out / SHARDS_DIR}; no server was needed"]
    if unresolved:
        lines.append(format_failures(unresolved, out, kept_aside=True))
    return Outcome(
        summary="\n".join(lines),
        interrupted=False,
        out_dir=out,
        exit_code=EXIT_FAILED_REQUESTS if unresolved else EXIT_DONE,
    )


def _family(tokenizer: Any, config: RunConfig, facts: TokenizerFacts, options: dict[str, Any]) -> Family:
    """The model family, detected by rendering; a preset's [tokens] facts are checked against it (a mismatch
    stops the run naming both values) and its stop ids join the stop set."""
    family = detect_family(tokenizer, config.chat_template_kwargs, stop_ids=facts.eos_token_ids)
    if config.mix is not None:  # each variant's kwargs may leave reasoning to the model where the run's do not
        variants = [{**config.chat_template_kwargs, **v.chat_template_kwargs} for v in config.mix.variants]
        family = family.with_variants([detect_family(tokenizer, kw) for kw in variants])
    tokens = options.get("preset_tokens")
    if tokens:
        try:
            family = apply_preset_tokens(family, tokens, tokenizer, config.preset or "preset")
        except PresetMismatch as exc:
            raise UsageError(str(exc)) from None
    return family


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _min(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


@dataclass
class Servers:
    """What :func:`_servers` yields: the pool, the facts behind it, and the client sized for it."""

    http: httpx.AsyncClient
    pool: ServerPool
    facts: list[ServerFacts]
    managed: ManagedServer | None
    concurrency: int
    transport: Transport


@contextlib.asynccontextmanager
async def _servers(config: RunConfig, out: Path) -> AsyncIterator[Servers]:
    """Launches or attaches, reads and checks server facts, and yields a pool. Always cleans up."""
    refuse_proxies(config.server.urls)
    tls = ssl_context(config.server.ca_bundle)  # one trust store for every connection of the run
    setup = make_http_client(max_connections=8, request_timeout_s=60.0, api_key=config.server.api_key, tls=tls)
    http: httpx.AsyncClient | None = None
    managed: ManagedServer | None = None
    pool: ServerPool | None = None
    transport = Transport(auth_headers(config.server.api_key), tls)
    try:
        if config.server.launch is not None:
            managed = ManagedServer(config.server.launch, out / "server.log", api_key=config.server.api_key)
            refuse_proxies([managed.url])
            echo(f"  starting SGLang: {' '.join(redact(managed.command))} (log: {managed.log_path})")
            await managed.start(setup)
            urls = [managed.url]
        else:
            urls = list(config.server.urls)
        if config.server.router is not None:
            router = ManagedRouter(config.server.router, out / "router.log", api_key=config.server.api_key)
            echo(f"  starting sglang-router: {' '.join(redact(router.command))} (log: {router.log_path})")
            await router.start(setup)
            managed, urls = router, [router.url]
        server_facts = [await read_server_facts(setup, url) for url in urls]
        check = FactsCheck(config.server.allow_reasoning_parser, model_vocab_size(config.tokenizer))
        check.start(server_facts)  # the same check runs again whenever a server comes back
        for facts in server_facts:
            if facts.workers:  # an sglang-router: every key any record may send must pass through it
                sent = dict(config.sampling.to_request())
                for variant in config.mix.variants if config.mix is not None else ():
                    sent.update(variant.sampling)
                if config.seed is not None:
                    sent["sampling_seed"] = config.seed
                check_router_passes(facts.url, facts.workers, sent)
        concurrency = config.concurrency or default_concurrency([f.max_running_requests for f in server_facts])
        # httpcore scans its whole pool on every request: size it to what is in flight, not larger.
        http = make_http_client(
            max_connections=concurrency + 8 * len(urls),
            request_timeout_s=config.request_timeout_s,
            api_key=config.server.api_key,
            tls=tls,
        )
        endpoints = [Endpoint(f.url, f.max_running_requests, f.max_req_input_len) for f in server_facts]
        recover = make_recover(http, managed, transport, check, outage_give_up_s=OUTAGE_GIVE_UP_S)
        pool = ServerPool(endpoints, recover, suspect_after=config.suspect_after_crashes, exited=exited(managed))
        yield Servers(http, pool, server_facts, managed, concurrency, transport)
    finally:
        if pool is not None:
            await pool.close()
        transport.close()
        if managed is not None:
            managed.stop()
        if http is not None:
            await http.aclose()
        await setup.aclose()


@dataclass
class StopSwitch:
    """Where SIGINT/SIGTERM go: before the pipeline exists they cancel the start-up at once (the
    server is still stopped on the way out); then the first asks the pipeline to stop sending."""

    grace_s: float
    pipeline: Pipeline | None = None
    hits: int = 0

    @property
    def stopped(self) -> bool:
        return self.hits > 0


@contextlib.contextmanager
def _signals(grace_s: float) -> Iterator[StopSwitch]:
    """First SIGINT/SIGTERM: stop sending, let requests in flight finish (up to ``grace_s``).
    Second: cancel at once; what was written stays consistent."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    switch = StopSwitch(grace_s)

    def handle(signum: int) -> None:
        switch.hits += 1
        name = signal.Signals(signum).name
        if switch.hits == 1 and switch.pipeline is not None:
            echo(
                f"\n{name}: stopping; waiting up to {grace_s:.0f} s for {switch.pipeline.pool.in_flight} "
                "requests in flight (press Ctrl-C again to exit at once)"
            )
            switch.pipeline.request_stop()
        elif main is not None:
            echo(f"\n{name}: stopping now")
            main.cancel()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handle, sig)
            installed.append(sig)
    try:
        yield switch
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
