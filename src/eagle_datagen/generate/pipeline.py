"""The fan-out: prompts → rendered work items → /generate on the pool → shards.

A producer thread reads and renders rows ahead of dispatch through a bounded queue, so memory stays
flat whatever the file size and the first request leaves within seconds. Each work item is a task of
one :class:`asyncio.TaskGroup` (at most ``2 × concurrency`` alive, ``concurrency`` requests in flight),
so every item ends exactly once and no exception dies unobserved. Transient failures are retried
with backoff; requests cut off by a server going down are requeued without being charged. Nothing
reaches a shard unless it passed the response checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from eagle_datagen.errors import BadInputError, OutputWriteError, PreflightFailed, RequestFailed, ServerError
from eagle_datagen.generate.client import GenerateResult, generate, is_healthy
from eagle_datagen.generate.limits import Limits
from eagle_datagen.generate.pool import BACKPRESSURE_STATUSES, Endpoint, ServerPool, backoff_s, counts_toward_down
from eagle_datagen.generate.transport import Transport
from eagle_datagen.generate.turns import Conversation, TurnDriver, TurnResult, TurnState, end_entry
from eagle_datagen.inputs.mix import Mix, RecordPlan
from eagle_datagen.inputs.prompts import PromptReader, PromptRow
from eagle_datagen.inputs.render import Rendered
from eagle_datagen.record.checks import RecordSpec
from eagle_datagen.record.tally import Tally
from eagle_datagen.store.logs import JsonlLog
from eagle_datagen.store.shards import ShardStore

log = logging.getLogger(__name__)

BATCH = 64
BACKPRESSURE_RETRIES = 10
PREFLIGHT_MAX_NEW_TOKENS = 16
#: Distinct prompts whose preflight output fails a record check before the preflight fails the run.
PREFLIGHT_CHECK_PROMPTS = 3
_END = object()
#: A row to render, the (record id, sample) pairs its render serves, and their conversations (``--turns all``).
_Staged = tuple[PromptRow, list[tuple[str, int]], list[Conversation] | None]
#: Renders chunks of rows, in order (``Renderer.render_chunks`` or ``RenderPool.render_chunks``).
ChunkRenderer = Callable[[Iterable[list[PromptRow]]], Iterator[list[Rendered]]]


@dataclass(slots=True)
class WorkItem:
    """One request to make: a record id and its rendered prompt."""

    record_id: str
    key: str
    sample: int
    line: int
    prompt_ids: list[int]
    attempts: int = 0
    #: a mix's or --seed's own sampling and record fields (``None``: the run's sampling, no extra fields)
    plan: RecordPlan | None = None
    #: 503/429 answers (back-pressure): retried on their own budget, BACKPRESSURE_RETRIES × --max-retries.
    busy: int = 0
    #: ``--turns all``: the conversation this item carries through its turns (``record_id`` is its current turn's)
    conversation: Conversation | None = None
    #: the server its conversation's earlier turns ran on (the radix cache holds their prefix)
    server: str | None = None


@dataclass
class Stats:
    """Counters for the progress bar and the summary."""

    started: float = field(default_factory=time.monotonic)
    failures: int = 0
    rejects: int = 0
    already_done: int = 0
    retries: int = 0
    requeued: int = 0
    #: records, output tokens and finish counts: the same counters ``eagle-datagen stats`` prints
    tally: Tally = field(default_factory=Tally)
    #: the record checks' warnings by kind (stop_in_reasoning, tool_call_ends_reasoning): written, and counted
    warnings: Counter[str] = field(default_factory=Counter)
    #: ``--turns all``: conversations ended, by reason (complete, truncated, tool_calls_differ, ...)
    ends: Counter[str] = field(default_factory=Counter)
    #: ``--turns all``: conversations cut short by a failed turn (its failure is in failures.jsonl)
    conversations_failed: int = 0
    #: ``--turns all``: turns the source had that will not be sent (their conversation ended or failed before)
    turns_not_sent: int = 0

    def add(self, result: GenerateResult, server: str | None = None, variant: str | None = None) -> None:
        self.warnings.update(kind for kind, _ in result.warnings)
        self.tally.add(len(result.output_ids), str(result.finish_reason.get("type")), server=server, variant=variant)

    @property
    def records(self) -> int:
        return self.tally.records

    @property
    def output_tokens(self) -> int:
        return self.tally.output_tokens

    @property
    def max_output(self) -> int:
        return self.tally.max_output

    @property
    def finish(self) -> Counter[str]:
        return self.tally.finish


def record_ids(key: str, samples_per_prompt: int) -> list[tuple[str, int]]:
    """Record ids of one prompt: its key, or ``key#i`` per sample when there are several."""
    if samples_per_prompt == 1:
        return [(key, 0)]
    return [(f"{key}#{i}", i) for i in range(samples_per_prompt)]


class Producer:
    """Reads and renders rows in a thread; hands batches of work items to the event loop.

    Rows render in chunks of :data:`BATCH` rows (:meth:`Renderer.render_chunks`, or
    :meth:`RenderPool.render_chunks` for worker processes), which is what keeps rendering off the
    critical path (docs/performance.md). Rows already done are skipped before rendering, and a row the
    template rejects is set aside or stops the run.
    """

    def __init__(
        self,
        reader: PromptReader,
        render_chunks: ChunkRenderer,
        *,
        samples_per_prompt: int,
        skip: Callable[[str], bool],
        limits: Limits,
        reject: Callable[[dict[str, Any]], None],
        stats: Stats,
        mix: Mix | None = None,
        record_plan: Callable[[str, int, str], RecordPlan | None] = lambda key, sample, rid: None,
        turns: TurnState | None = None,
        on_truncated: str = "stop",
    ) -> None:
        self.turns = turns
        self.on_truncated = on_truncated
        self.mix = mix
        self.record_plan = record_plan
        self.reader = reader
        self.render_chunks = render_chunks
        self.samples_per_prompt = samples_per_prompt
        self.skip = skip
        self.limits = limits
        self.reject = reject
        self.stats = stats
        self.queue: queue.Queue[object] = queue.Queue(maxsize=8)
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle-datagen-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _put(self, value: object) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(value, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            batch: list[WorkItem] = []
            for items in self._rendered():
                if self.stop.is_set():
                    return
                batch.extend(items)
                if len(batch) >= BATCH:
                    if not self._put(batch):
                        return
                    batch = []
            if self.stop.is_set() or (batch and not self._put(batch)):
                return
            self._put(_END)
        except BaseException as exc:  # handed to the loop, which stops the run cleanly
            self._put(exc)

    def _rendered(self) -> Iterator[list[WorkItem]]:
        """The work items of each row, in file order."""
        staged: deque[list[_Staged]] = deque()
        for results in self.render_chunks(self._chunks(staged)):
            for (row, wanted, conversations), rendered in zip(staged.popleft(), results, strict=True):
                if isinstance(rendered, BadInputError):
                    self._bad_row(rendered)
                    continue
                yield self._checked_items(row, wanted, rendered, conversations)

    def _chunks(self, staged: deque[list[_Staged]]) -> Iterator[list[PromptRow]]:
        """Chunks of rows still to do; each chunk's (row, wanted ids, conversations) are staged for its result."""
        chunk: list[_Staged] = []
        for row in self.reader:
            if self.stop.is_set():
                return
            wanted = self._wanted(row)
            pairs = (
                self.mix.split(row, wanted) if wanted and self.mix is not None else [(row, wanted)] if wanted else []
            )
            for variant, subset in pairs:  # a mix: one copy of the row per variant its samples take
                if self.turns is None:
                    chunk.append((variant, subset, None))
                else:
                    chunk += self._conversations(variant, subset)
            if len(chunk) >= BATCH:
                staged.append(chunk)
                yield [row for row, _, _ in chunk]
                chunk = []
        if chunk:
            staged.append(chunk)
            yield [row for row, _, _ in chunk]

    def _conversations(self, row: PromptRow, wanted: list[tuple[str, int]]) -> list[_Staged]:
        """``--turns all``: what each wanted conversation sends next. Those starting afresh render together (turn 1
        is the same conversation for every sample); one going on from an earlier run renders its next turn."""
        assert self.turns is not None
        fresh: list[tuple[str, int]] = []
        fresh_conversations: list[Conversation] = []
        out: list[_Staged] = []
        for base, sample in wanted:
            conversation = self.turns.start(row, base, self.on_truncated)
            if conversation is None:
                self.stats.already_done += 1
            elif conversation.turn == 1:
                fresh.append((conversation.record_id, sample))
                fresh_conversations.append(conversation)
            else:
                turn_row = dataclasses.replace(row, messages=conversation.messages, turn_plan=None)
                out.append((turn_row, [(conversation.record_id, sample)], [conversation]))
        if fresh:  # the renderer gets the turn's messages only (the plan stays with the conversations)
            first = dataclasses.replace(row, messages=fresh_conversations[0].messages, turn_plan=None)
            out.insert(0, (first, fresh, fresh_conversations))
        return out

    def _wanted(self, row: PromptRow) -> list[tuple[str, int]]:
        if self.turns is not None:  # conversations: which turn each goes on from is the turn state's to say
            return record_ids(row.key, self.samples_per_prompt)
        wanted = [(rid, s) for rid, s in record_ids(row.key, self.samples_per_prompt) if not self.skip(rid)]
        self.stats.already_done += self.samples_per_prompt - len(wanted)
        return wanted

    def _bad_row(self, exc: BadInputError) -> None:
        if self.reader.on_bad is None:
            raise exc
        self.stats.rejects += 1
        self.reader.on_bad(exc)

    def _checked_items(
        self,
        row: PromptRow,
        wanted: list[tuple[str, int]],
        prompt_ids: list[int],
        conversations: list[Conversation] | None = None,
    ) -> list[WorkItem]:
        problem = self.limits.problem(prompt_ids)
        if problem is not None:
            kind, message = problem
            extra = {"prompt_tokens": len(prompt_ids)} if kind == "too_long" else {}
            self._set_aside(row, kind, message, **extra)
            return []
        items = [
            WorkItem(rid, row.key, s, row.line, prompt_ids, plan=self.record_plan(row.key, s, rid)) for rid, s in wanted
        ]
        for item, conversation in zip(items, conversations or (), strict=False):
            item.conversation = conversation
        return items

    def _set_aside(self, row: PromptRow, kind: str, message: str, **extra: Any) -> None:
        self.stats.rejects += 1
        self.reject({"line": row.line, "key": row.key, "kind": kind, "message": message, **extra})

    def batches(self, timeout_s: float = 0.2) -> object:
        """The next batch, ``_END``, an exception from the thread, or ``None`` on timeout."""
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None


class Pipeline:
    """Runs every work item to a record or a recorded failure, or stops cleanly when asked.

    Every task the run starts belongs to one :class:`asyncio.TaskGroup`: the feeder (which hands
    rendered items out and sends the preflight), one task per work item (bounded by
    ``2 × concurrency`` items and ``concurrency`` requests in flight) and the monitor. :meth:`run`
    cannot return while any of them is alive, and none can die unobserved: an item ends exactly once
    (its ``finally``), and any exception in the feeder, an item or the monitor becomes the run's
    fatal error, which stops dispatch, lets the requests in flight finish (up to ``grace_s``; at
    once for a write error) and is raised by :meth:`run`.
    """

    def __init__(
        self,
        *,
        producer: Producer,
        pool: ServerPool,
        http: httpx.AsyncClient,
        transport: Transport,
        request_timeout_s: float,
        store: ShardStore,
        failures: JsonlLog,
        sampling_params: dict[str, Any],
        spec: RecordSpec | None,
        concurrency: int,
        max_retries: int,
        checkpoint_records: int,
        checkpoint_interval_s: float,
        stall_timeout_s: float,
        preflight: bool,
        stats: Stats,
        on_progress: Callable[[], None] = lambda: None,
        turns: TurnDriver | None = None,
        ends: JsonlLog | None = None,
    ) -> None:
        self.turns = turns
        self.ends = ends
        self.producer = producer
        self.pool = pool
        self.http = http
        self.transport = transport
        self.request_timeout_s = request_timeout_s
        self.store = store
        self.failures = failures
        self.sampling_params = sampling_params
        self.spec = spec
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.checkpoint_records = checkpoint_records
        self.checkpoint_interval_s = checkpoint_interval_s
        self.stall_timeout_s = stall_timeout_s
        self.preflight = preflight
        self.stats = stats
        self.on_progress = on_progress
        self.stopping = asyncio.Event()
        self.fatal: BaseException | None = None
        self._items_ahead = asyncio.Semaphore(concurrency * 2)
        self._requests = asyncio.Semaphore(concurrency)
        self._items: set[asyncio.Task[None]] = set()
        self._sending: set[asyncio.Task[Any]] = set()
        self._settled = asyncio.Event()
        self._settled.set()
        self._feeder: asyncio.Task[None] | None = None
        self._grace_s = 0.0
        self._grace_timer: asyncio.TimerHandle | None = None
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._session = secrets.token_hex(4)
        self._counter = 0
        self._preflight_checks_failed = 0

    def request_stop(self) -> None:
        """Stop sending; requests in flight may finish within the grace period of :meth:`run`.

        Items not in flight (waiting for a slot, a server or a retry backoff) end at once, unsent
        (``resume`` sends them); so does the preflight. What was accepted is fsynced at once, before
        the drain, not after it.
        """
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.producer.stop.set()
        current = asyncio.current_task()
        if self._feeder is not None and self._feeder is not current:
            self._feeder.cancel()
        for task in self._items - self._sending:
            if task is not current:
                task.cancel()
        with contextlib.suppress(RuntimeError):  # no running loop: nothing is in flight
            self._grace_timer = asyncio.get_running_loop().call_later(self._grace_s, self._cancel_in_flight)
        self._checkpoint_on_stop()

    def _checkpoint_on_stop(self) -> None:
        try:
            self.checkpoint()
        except OutputWriteError as exc:
            self._fail_run(exc)

    def _cancel_in_flight(self) -> None:
        """The grace period is over (or nothing more can be written): abandon what is in flight."""
        current = asyncio.current_task()
        for task in list(self._items):
            if task is not current:
                task.cancel()

    async def run(self, grace_s: float) -> None:
        """Runs to the end of the prompts, or until :meth:`request_stop` (then waits up to ``grace_s``
        for requests in flight). Raises the run's fatal error, if any, once everything it started has
        ended. Shards are checkpointed when this returns or raises."""
        self._grace_s = grace_s
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle-datagen-feed")
        try:
            async with asyncio.TaskGroup() as group:
                monitor = group.create_task(self._monitor(), name="eagle-datagen-monitor")
                self._feeder = group.create_task(self._feed(group, executor), name="eagle-datagen-feeder")
                if self.stopping.is_set():  # asked to stop before the run began
                    self._feeder.cancel()
                self.producer.start()
                await asyncio.wait({self._feeder})
                while self._items:
                    await self._settled.wait()
                monitor.cancel()
        finally:
            self.producer.stop.set()
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            executor.shutdown(wait=False, cancel_futures=True)
            try:
                self.checkpoint()
            except Exception as exc:  # recorded, not raised over what is already propagating
                self._note_fatal(exc)
        fatal = self.fatal or self.pool.fatal
        if fatal is not None:
            raise fatal

    def _note_fatal(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        elif exc is not self.fatal:
            log.error("also: %s", exc)

    def _fail_run(self, exc: BaseException) -> None:
        """A fatal error anywhere in the run: stop dispatch, drain, and surface it from :meth:`run`.

        Requests in flight still finish (within the grace period) so their GPU work is kept, except
        after a write error: then nothing more can be recorded, and they are abandoned at once.
        """
        self._note_fatal(exc)
        self.request_stop()
        if isinstance(exc, OutputWriteError):
            self._cancel_in_flight()

    async def _feed(self, group: asyncio.TaskGroup, executor: ThreadPoolExecutor) -> None:
        try:
            await self._dispatch(group, executor)
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
        except Exception as exc:
            self._fail_run(exc)

    async def _dispatch(self, group: asyncio.TaskGroup, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        first = self.preflight
        #: prompts whose preflight output failed a record check: sent once a preflight passes (or at the end)
        held: list[WorkItem] = []
        while True:
            batch = await loop.run_in_executor(executor, self.producer.batches)
            if batch is None:
                continue
            if batch is _END:
                for item in held:  # no other prompt was left to pass the preflight: they go the normal way
                    await self._start_item(group, item)
                return
            if isinstance(batch, BaseException):
                raise batch
            assert isinstance(batch, list)
            for item in batch:
                if first and not self.pool.crashes.suspect(item.record_id):  # a suspect goes alone, unchecked
                    checks_failed = self._preflight_checks_failed
                    first = not await self._preflight(item)
                    if self._preflight_checks_failed > checks_failed:
                        held.append(item)
                        continue
                    if not first:
                        for waiting in held:
                            await self._start_item(group, waiting)
                        held.clear()
                await self._start_item(group, item)

    async def _start_item(self, group: asyncio.TaskGroup, item: WorkItem) -> None:
        await self._items_ahead.acquire()
        task = group.create_task(self._item(item))
        self._items.add(task)
        self._settled.clear()
        task.add_done_callback(self._item_done)

    def _item_done(self, task: asyncio.Task[None]) -> None:
        self._items.discard(task)
        if not self._items:
            self._settled.set()

    async def _preflight(self, item: WorkItem) -> bool:
        """One short, fully checked request before any real one (cancelled at once by a stop).

        A busy server's 503/429 is waited out (``Retry-After`` honoured), not taken for a failed preflight.
        A server that dies on it (connection failure, timeout, 5xx) is an outage, charged to this item as
        a crash: False, and the next item is the preflight (this one goes the normal way)."""
        params = {
            **self.sampling_params,
            "max_new_tokens": min(PREFLIGHT_MAX_NEW_TOKENS, self.sampling_params["max_new_tokens"]),
        }
        busy = 0
        while True:
            endpoint = await self.pool.acquire()
            try:
                await generate(
                    self.transport, endpoint.url, item.prompt_ids, params, self._rid(),
                    timeout_s=self.request_timeout_s, spec=self.spec,
                )  # fmt: skip
                return True
            except RequestFailed as exc:
                busy += 1
                if counts_toward_down(exc):
                    self.pool.failed(endpoint, item.record_id, connection=exc.kind == "connection")
                    return False
                if exc.kind.startswith("check_") and self._preflight_checks_failed < PREFLIGHT_CHECK_PROMPTS - 1:
                    # This prompt's output failed a record check (the model wrote <think> with thinking off, ...):
                    # it may be the record itself (a resume retrying it), not the server. The next prompt is the
                    # preflight; this one is sent the normal way once one passes. Only PREFLIGHT_CHECK_PROMPTS
                    # prompts in a row failing their checks stop the run.
                    self._preflight_checks_failed += 1
                    log.warning(
                        "preflight: %s failed its record check (%s); trying the next prompt", item.record_id, exc
                    )
                    return False
                if exc.status not in BACKPRESSURE_STATUSES or busy > BACKPRESSURE_RETRIES * max(1, self.max_retries):
                    raise PreflightFailed(
                        f"preflight request to {endpoint.url} failed ({exc.kind}: {exc.message}); nothing was sent. "
                        "Check the server and the tokenizer, then continue with `eagle-datagen resume`"
                    ) from exc
                delay = self.pool.backpressure(endpoint, exc.retry_after_s, busy)
            finally:
                self.pool.release(endpoint)
            await asyncio.sleep(delay)

    def _rid(self) -> str:
        # Fixed width: SGLang aborts by rid prefix, so no rid may be a prefix of another.
        self._counter += 1
        return f"edg-{self._session}-{self._counter:012d}"

    async def _item(self, item: WorkItem) -> None:
        """One work item, from dispatch to a record, a recorded failure, or a stop (then resume sends it)."""
        try:
            while not self.stopping.is_set():
                delay = await self._attempt(item)
                if delay is None:
                    return
                if delay > 0 and not self.stopping.is_set():
                    await asyncio.sleep(delay)  # a stop cancels the sleep: the item is not in flight
        except Exception as exc:
            self._fail_run(exc)
        finally:
            self._items_ahead.release()
            try:
                self.on_progress()
            except Exception as exc:  # the progress bar (stderr closed, ...) must not end an item unseen
                self._fail_run(exc)

    async def _attempt(self, item: WorkItem) -> float | None:
        """Sends ``item`` once. ``None``: it ended (a record or a failure); else try again after that many s."""
        crashes = self.pool.culprit(item.record_id)
        if crashes is not None:
            message = (
                f"the server crashed each time this request was in flight ({crashes} crashes in a row, the last "
                "while it ran alone); set aside so the run goes on"
            )
            self._record_failure(item, RequestFailed("server_crash", message, retryable=False))
            return None
        async with self._requests:
            endpoint = await self.pool.acquire(item.record_id, prefer=item.server)
            started = time.time()
            request = asyncio.create_task(
                generate(
                    self.transport,
                    endpoint.url,
                    item.prompt_ids,
                    self.sampling_params if item.plan is None else item.plan.sampling_params,
                    self._rid(),
                    timeout_s=self.request_timeout_s,
                    spec=self.spec,
                )
            )
            self.pool.track(endpoint, request, item.record_id)  # an outage cancels it: then the item is requeued
            me = asyncio.current_task()
            assert me is not None
            self._sending.add(me)
            try:
                await asyncio.wait({request})
            finally:
                self._sending.discard(me)
                endpoint.tasks.pop(request, None)
                self.pool.release(endpoint, item.record_id)
                if not request.done():
                    request.cancel()
                elif not request.cancelled():
                    request.exception()  # looked at, even when a stop cut this item off before it could be
        if request.cancelled():
            self.stats.requeued += 1
            return 0.0
        exc = request.exception()
        if exc is None:
            self.pool.succeeded(endpoint, item.record_id)
            if item.conversation is not None:
                return await self._turn(item, request.result(), endpoint, started)
            self._write(item, request.result(), endpoint.url, started)
            return None
        if isinstance(exc, RequestFailed):
            return self._failed(item, endpoint, exc)
        raise exc

    async def _turn(self, item: WorkItem, result: GenerateResult, endpoint: Endpoint, started: float) -> float | None:
        """A conversation's turn came back: parse it, find the next turn, write this one; ``0.0`` sends the next.

        The item stays among those in flight while it parses and renders (a stop lets it finish and write), but
        holds no request slot, so the other conversations keep the servers full."""
        assert self.turns is not None and item.conversation is not None
        conversation = item.conversation
        me = asyncio.current_task()
        assert me is not None
        self._sending.add(me)
        try:
            outcome = await self._parse_and_advance(item, result, endpoint)
        finally:
            self._sending.discard(me)
        if outcome is None:  # the parsers could not be reached: recorded as this turn's failure
            return None
        self._write(item, result, endpoint.url, started, outcome)
        if outcome.end is not None:
            self.stats.ends[outcome.end] += 1
            self.stats.turns_not_sent += conversation.plan.turns - conversation.turn
            if self.ends is not None:
                self.ends.append(
                    end_entry(
                        conversation.base_id, item.record_id, item.key, item.sample, conversation.turn,
                        outcome.end, outcome.detail,
                    )
                )  # fmt: skip
            return None
        assert outcome.next_messages is not None and outcome.next_prompt_ids is not None
        conversation.turn += 1
        conversation.messages = outcome.next_messages
        item.record_id = conversation.record_id
        item.prompt_ids = outcome.next_prompt_ids
        item.attempts = item.busy = 0
        item.server = endpoint.url
        item.plan = self.producer.record_plan(item.key, item.sample, item.record_id)
        try:
            self.on_progress()
        except Exception as exc:
            self._fail_run(exc)
        return 0.0

    async def _parse_and_advance(self, item: WorkItem, result: GenerateResult, endpoint: Endpoint) -> TurnResult | None:
        """The parsed reply and what follows; the parsers are retried like a request (backoff, --max-retries)."""
        assert self.turns is not None and item.conversation is not None
        url = endpoint.url
        for attempt in range(self.max_retries + 1):
            try:
                reply = await self.turns.parse(url, item.conversation, item.prompt_ids, result.output_ids)
                break
            except ServerError as exc:
                if attempt == self.max_retries:
                    self._record_failure(item, RequestFailed("parse_failed", str(exc), retryable=False))
                    return None
                self.stats.retries += 1
                await asyncio.sleep(backoff_s(attempt + 1))
                url = next((e.url for e in self.pool.endpoints if e.up), url)
        return await self.turns.advance(item.conversation, reply, str(result.finish_reason.get("type")))

    def _failed(self, item: WorkItem, endpoint: Endpoint, exc: RequestFailed) -> float | None:
        endpoint.last_progress = time.monotonic()
        if not exc.retryable:
            if exc.status is not None:  # the server answered: it is alive
                self.pool.succeeded(endpoint, item.record_id)
            self._record_failure(item, exc)
            return None
        if exc.status in BACKPRESSURE_STATUSES:  # busy, not down: slow down there, keep what runs
            item.busy += 1
            if item.busy > BACKPRESSURE_RETRIES * max(1, self.max_retries):
                self._record_failure(item, exc)
                return None
            self.stats.retries += 1
            return self.pool.backpressure(endpoint, exc.retry_after_s, item.busy)
        if counts_toward_down(exc) and self.pool.failed(endpoint, item.record_id, connection=exc.kind == "connection"):
            self.stats.requeued += 1
            return 0.0
        item.attempts += 1
        if item.attempts > self.max_retries:
            self._record_failure(item, exc)
            return None
        self.stats.retries += 1
        return backoff_s(item.attempts)

    def _record_failure(self, item: WorkItem, exc: RequestFailed) -> None:
        entry: dict[str, Any] = {
            "id": item.record_id,
            "key": item.key,
            "sample": item.sample,
            "line": item.line,
            "kind": exc.kind,
            "message": exc.message,
            "status": exc.status,
            "attempts": item.attempts + 1,
        }
        if item.conversation is not None:  # the rest of the conversation fails with it (resume retries it)
            entry["turn"] = item.conversation.turn
            entry["conversation"] = item.key
            self.stats.conversations_failed += 1
            self.stats.turns_not_sent += item.conversation.plan.turns - item.conversation.turn
        self.failures.append(entry)
        self.stats.failures += 1

    def _write(
        self, item: WorkItem, result: GenerateResult, server: str, started: float, turn: TurnResult | None = None
    ) -> None:
        record: dict[str, Any] = {"id": item.record_id, "key": item.key, "sample": item.sample}
        if item.conversation is not None and turn is not None:
            record.update(item.conversation.fields())
            record["end"] = turn.end
        record.update({
            "prompt_ids": item.prompt_ids,
            "output_ids": result.output_ids,
            "finish_reason": result.finish_reason,
            "completion_tokens": result.completion_tokens,
            # wall-clock stamps (Unix seconds) and the server, for `eagle-datagen stats` throughput
            "started": round(started, 3),
            "finished": round(time.time(), 3),
            "server": server,
        })  # fmt: skip
        if item.conversation is not None and turn is not None:
            record["messages"] = item.conversation.messages  # what prompt_ids was rendered from
            record["reply"] = turn.reply  # this turn as the parsers split it: the next turn's history message
            if turn.detail:
                record["end_detail"] = turn.detail
        if item.plan is not None:  # variant, its template kwargs, the sampling params sent
            record.update(item.plan.fields)
        self.store.append(item.record_id, orjson.dumps(record) + b"\n")
        self.stats.add(result, server, None if item.plan is None else item.plan.fields.get("variant"))
        self._unsynced += 1
        if (
            self._unsynced >= self.checkpoint_records
            or time.monotonic() - self._last_sync >= self.checkpoint_interval_s
        ):
            self.checkpoint()

    def checkpoint(self) -> None:
        """fsync the shard and the failure log."""
        self.store.checkpoint()
        self.failures.checkpoint()
        if self.ends is not None:
            self.ends.checkpoint()
        self._unsynced = 0
        self._last_sync = time.monotonic()

    async def _monitor(self) -> None:
        """Time-based checkpoints, the pool's fatal error, and stall detection (no progress for
        ``stall_timeout_s`` → health check). Any exception here is the run's fatal error."""
        try:
            while True:
                await asyncio.sleep(min(5.0, self.checkpoint_interval_s))
                await self._watch()
        except Exception as exc:
            self._fail_run(exc)

    async def _watch(self) -> None:
        if self.pool.fatal is not None and self.fatal is None:
            self._fail_run(self.pool.fatal)
        if self._unsynced and time.monotonic() - self._last_sync >= self.checkpoint_interval_s:
            self.checkpoint()
        now = time.monotonic()
        for endpoint in self.pool.endpoints:
            if endpoint.up and endpoint.in_flight and now - endpoint.last_progress > self.stall_timeout_s:
                if await is_healthy(self.http, endpoint.url):
                    endpoint.last_progress = time.monotonic()
                else:
                    self.pool.mark_down(endpoint, f"no progress for {self.stall_timeout_s:.0f} s and unhealthy")
