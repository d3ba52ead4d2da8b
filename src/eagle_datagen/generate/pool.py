"""The servers a run sends to, and which of them are usable right now.

Work goes to the healthy server with the fewest requests in flight, below that server's in-flight target.

- **An outage** is what only a dead or unreachable server gives: connection failures, timeouts and 5xx
  other than 503 (:func:`counts_toward_down`). ``down_after`` of them in a row, or fewer when every request
  that was in flight failed (or one, when the launched server's process has exited), take the server out of
  the pool: its in-flight requests are cancelled and
  requeued, and a recovery task (a health probe with backoff, or a restart for a managed server) brings
  it back. While no server is up, dispatch waits instead of burning every prompt's retries.
- **Back-pressure** is what a busy, healthy server gives: 503 ("The request queue is full.") and 429
  (:data:`BACKPRESSURE_STATUSES`). It never counts toward an outage and cancels nothing: the server's
  in-flight target is lowered (multiplicatively, at most once per :data:`CUT_EVERY_S`, never below the
  ``max_running_requests`` it reported) and recovers by one per success; ``Retry-After`` pauses new
  dispatch to that server until then.
- **Crashes** are charged to the requests in flight (:class:`CrashLedger`): a request in flight at
  ``suspect_after`` consecutive crashes is sent alone, and if the server dies while it runs alone it is
  the culprit: the pipeline sets it aside as a ``server_crash`` failure and the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from eagle_datagen.errors import RequestFailed

log = logging.getLogger(__name__)

#: Brings a down endpoint back; returns True when it is usable again.
Recover = Callable[["Endpoint"], Awaitable[bool]]
#: Statuses of a healthy but busy server (or router): slow down, never count toward an outage.
BACKPRESSURE_STATUSES = frozenset({429, 503})
#: The in-flight target is cut to this fraction of what was in flight, at most once per CUT_EVERY_S.
CUT_FACTOR = 0.75
CUT_EVERY_S = 1.0
#: ``Retry-After`` is honoured up to this long.
MAX_RETRY_AFTER_S = 600.0
#: Consecutive crashes a request must be in flight at before it is sent alone.
DEFAULT_SUSPECT_AFTER = 2


def counts_toward_down(exc: RequestFailed) -> bool:
    """True for what only a dead or unreachable server gives: connection failures, timeouts, 5xx but 503."""
    if exc.kind in ("connection", "timeout"):
        return True
    return exc.status is not None and exc.status >= 500 and exc.status not in BACKPRESSURE_STATUSES


@dataclass(eq=False)
class Endpoint:
    """One server URL and its live counters."""

    url: str
    max_running_requests: int | None = None
    max_req_input_len: int | None = None
    up: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    #: Requests in flight when the first of those failures came (this one included).
    in_flight_at_failure: int = 0
    completed: int = 0
    downs: int = 0
    #: Requests in flight here, each with the record id it is for (a crash charges them).
    tasks: dict[asyncio.Task[Any], str | None] = field(default_factory=dict)
    last_progress: float = field(default_factory=time.monotonic)
    #: In-flight target after back-pressure (None: no target, the run's concurrency bounds it).
    limit: float | None = None
    backpressured: int = 0
    paused_until: float = 0.0
    last_cut: float = float("-inf")
    #: Record ids whose request failed here (toward an outage) since the last success: in flight at a crash.
    failing: set[str] = field(default_factory=set)
    #: A suspect waits for this endpoint to drain (no new work goes here), then runs alone.
    reserved_for: str | None = None
    solo: str | None = None
    #: The last request that ran alone here, until a success shows the server survived it.
    last_solo: str | None = None
    #: The last outage was explained by a request that crashed the server alone (a restart is not charged).
    crash_explained: bool = False

    def open_for(self, now: float) -> bool:
        """Takes ordinary work now: up, not reserved for a suspect, not paused, below its target."""
        return (
            self.up
            and self.reserved_for is None
            and self.paused_until <= now
            and (self.limit is None or self.in_flight < self.limit)
        )


class CrashLedger:
    """Which requests were in flight at each crash; suspects run alone, culprits are set aside."""

    def __init__(self, suspect_after: int = DEFAULT_SUSPECT_AFTER) -> None:
        if suspect_after < 1:
            raise ValueError("suspect_after must be at least 1")
        self.suspect_after = suspect_after
        self.crashes = 0
        #: record id -> (serial of the last crash it was in flight at, consecutive crashes so far)
        self._charged: dict[str, tuple[int, int]] = {}
        self.culprits: dict[str, int] = {}

    def charge(self, keys: Iterable[str], *, alone: str | None = None) -> None:
        """A crash with ``keys`` in flight; ``alone`` ran alone, so it is the culprit."""
        self.crashes += 1
        for key in keys:
            last, count = self._charged.get(key, (0, 0))
            self._charged[key] = (self.crashes, count + 1 if last == self.crashes - 1 else 1)
        if alone is not None:
            self.culprits[alone] = self._charged.get(alone, (0, 1))[1]

    def preload(self, keys: Iterable[str]) -> None:
        """Requests that crashed a server alone in an earlier run: suspects from the start (sent alone first)."""
        for key in keys:
            self._charged[key] = (self.crashes, self.suspect_after)

    def crashes_with(self, key: str) -> int:
        """Consecutive crashes ``key`` was in flight at (0 once a crash passed without it)."""
        last, count = self._charged.get(key, (0, 0))
        return count if last == self.crashes else 0

    def suspect(self, key: str | None) -> bool:
        return key is not None and key not in self.culprits and self.crashes_with(key) >= self.suspect_after

    def cleared(self, key: str | None) -> None:
        """``key`` got a response: whatever crashed, it was not this."""
        if key is not None:
            self._charged.pop(key, None)


class ServerPool:
    """Picks endpoints, tracks failures and back-pressure, and runs recovery for endpoints that went down."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        recover: Recover,
        *,
        down_after: int = 5,
        suspect_after: int = DEFAULT_SUSPECT_AFTER,
        exited: Callable[[Endpoint], str | None] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a pool needs at least one endpoint")
        self.endpoints = endpoints
        self.recover = recover
        self.down_after = down_after
        self.crashes = CrashLedger(suspect_after)
        #: Why the endpoint's server process is gone (a launched server), or None while it runs.
        self.exited = exited
        self._changed = asyncio.Event()
        self._waiting = 0
        self._recoveries: dict[Endpoint, asyncio.Task[None]] = {}
        self.fatal: BaseException | None = None

    @property
    def any_up(self) -> bool:
        return any(e.up for e in self.endpoints)

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    async def acquire(self, key: str | None = None, *, prefer: str | None = None) -> Endpoint:
        """An endpoint for the request for ``key``: ``prefer`` (a URL: where a conversation's earlier turns ran,
        whose radix cache holds their prefix) when it is open, else the open one with the fewest requests in
        flight; a suspect gets an endpoint with nothing else in flight. Waits while there is none."""
        while True:
            if self.fatal is not None:
                raise self.fatal
            solo = self.crashes.suspect(key)  # a crash while this waits may clear it
            if not solo:
                self._unreserve(key)
            now = time.monotonic()
            endpoint = self._solo_endpoint(key, now) if solo else self._open_endpoint(now, prefer)
            if endpoint is not None:
                endpoint.in_flight += 1
                if solo:
                    endpoint.solo = key
                    endpoint.failing.clear()  # nothing else is in flight here now
                return endpoint
            await self._wait_for_change(now)

    def _open_endpoint(self, now: float, prefer: str | None = None) -> Endpoint | None:
        candidates = [e for e in self.endpoints if e.open_for(now)]
        if not candidates:
            return None
        if prefer is not None:
            sticky = next((e for e in candidates if e.url == prefer), None)
            if sticky is not None:
                return sticky
        low = min(e.in_flight for e in candidates)
        return random.choice([e for e in candidates if e.in_flight == low])

    def _solo_endpoint(self, key: str | None, now: float) -> Endpoint | None:
        """The endpoint reserved for ``key`` once it has drained; reserves one first if none is."""
        mine = next((e for e in self.endpoints if e.reserved_for == key), None)
        if mine is not None and not mine.up:
            mine.reserved_for = None
            mine = None
        if mine is None:
            free = [e for e in self.endpoints if e.up and e.reserved_for is None and e.paused_until <= now]
            if not free:
                return None
            mine = min(free, key=lambda e: e.in_flight)
            mine.reserved_for = key
            log.warning(
                "request %s was in flight at %d crashes in a row: sending it alone to %s",
                key,
                self.crashes.crashes_with(key or ""),
                mine.url,
            )
        return mine if mine.in_flight == 0 and mine.paused_until <= now else None

    def _unreserve(self, key: str | None) -> None:
        for endpoint in self.endpoints:
            if key is not None and endpoint.reserved_for == key and endpoint.solo is None:
                endpoint.reserved_for = None

    async def _wait_for_change(self, now: float) -> None:
        paused = [e.paused_until - now for e in self.endpoints if e.up and e.paused_until > now]
        self._changed.clear()
        self._waiting += 1
        try:
            if paused:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(paused))
            else:
                await self._changed.wait()
        finally:
            self._waiting -= 1

    def _wake(self) -> None:
        if self._waiting:
            self._changed.set()

    def track(self, endpoint: Endpoint, task: asyncio.Task[Any], key: str | None = None) -> None:
        """``task`` is the request for ``key`` in flight at ``endpoint`` (an outage cancels it)."""
        endpoint.tasks[task] = key

    def release(self, endpoint: Endpoint, key: str | None = None) -> None:
        endpoint.in_flight -= 1
        if key is not None and endpoint.solo == key:  # its answer (or failure) is in: others may go there again
            endpoint.solo = endpoint.reserved_for = None
            endpoint.last_solo = key
        self._wake()

    def succeeded(self, endpoint: Endpoint, key: str | None = None) -> None:
        """A response (any the server gave while alive): the outage count resets and the target recovers."""
        endpoint.consecutive_failures = 0
        endpoint.completed += 1
        endpoint.last_progress = time.monotonic()
        endpoint.failing.clear()
        endpoint.last_solo = None
        if endpoint.limit is not None:
            endpoint.limit += 1.0
        self.crashes.cleared(key)

    def failed(self, endpoint: Endpoint, key: str | None = None, *, connection: bool = False) -> bool:
        """Counts a failure toward an outage (:func:`counts_toward_down`); True when the endpoint is (now) down.

        The connection of a request that ran alone failing, or the launched server's process gone, is a crash
        at once; otherwise ``down_after`` failures in a row are."""
        if not endpoint.up:
            return True
        if key is not None:
            endpoint.failing.add(key)
        if endpoint.consecutive_failures == 0:
            endpoint.in_flight_at_failure = endpoint.in_flight + 1
        endpoint.consecutive_failures += 1
        gone = self.exited(endpoint) if self.exited is not None else None
        if gone is None and connection and key is not None and endpoint.last_solo == key:
            gone = "the connection failed while one request ran alone there"
        if gone is not None:
            self.mark_down(endpoint, gone)
            return True
        # every request that was in flight failed (fewer than down_after after a restart, or at low load)
        if endpoint.consecutive_failures >= min(self.down_after, endpoint.in_flight_at_failure):
            self.mark_down(endpoint, f"{endpoint.consecutive_failures} failures in a row")
            return True
        return False

    def backpressure(self, endpoint: Endpoint, retry_after_s: float | None, attempt: int) -> float:
        """A 503/429 from a live server: lower its target, honour ``Retry-After``; the delay before the retry."""
        now = time.monotonic()
        endpoint.backpressured += 1
        endpoint.last_progress = now
        if now - endpoint.last_cut >= CUT_EVERY_S:
            floor = float(endpoint.max_running_requests or 1)
            before = endpoint.limit
            endpoint.limit = max(floor, (endpoint.in_flight + 1) * CUT_FACTOR)
            endpoint.last_cut = now
            if before is None or endpoint.limit < before:
                log.info(
                    "server %s is busy (503/429): at most %.0f requests in flight there", endpoint.url, endpoint.limit
                )
        if retry_after_s is not None and retry_after_s > 0:
            wait_s = min(retry_after_s, MAX_RETRY_AFTER_S)
            endpoint.paused_until = max(endpoint.paused_until, now + wait_s)
            return wait_s + random.uniform(0, min(1.0, wait_s / 10))
        return backoff_s(attempt, base_s=0.25, cap_s=10.0)

    def culprit(self, key: str) -> int | None:
        """Crashes ``key`` was in flight at when it is the culprit (it crashed a server while running alone)."""
        return self.crashes.culprits.get(key)

    def mark_down(self, endpoint: Endpoint, reason: str) -> None:
        """Takes ``endpoint`` out of the pool, charges and cancels its requests (they are requeued), recovers it."""
        if not endpoint.up:
            return
        endpoint.up = False
        endpoint.downs += 1
        in_flight = {key for key in endpoint.tasks.values() if key is not None} | endpoint.failing
        ran_alone = endpoint.solo or endpoint.last_solo
        alone = ran_alone if ran_alone in in_flight else None
        self.crashes.charge(in_flight, alone=alone)
        endpoint.crash_explained = alone is not None
        endpoint.failing.clear()
        endpoint.reserved_for = endpoint.solo = endpoint.last_solo = None
        if alone is not None:
            log.warning(
                "server %s is down (%s) while request %s ran alone: that request is set aside (server_crash)",
                endpoint.url,
                reason,
                alone,
            )
        else:
            log.warning("server %s is down (%s); its requests go back to the queue", endpoint.url, reason)
        for task in list(endpoint.tasks):
            task.cancel()
        self._recoveries[endpoint] = asyncio.create_task(self._recover(endpoint))
        self._wake()

    def mark_up(self, endpoint: Endpoint) -> None:
        endpoint.up = True
        endpoint.consecutive_failures = 0
        endpoint.last_progress = time.monotonic()
        endpoint.paused_until = 0.0
        self._changed.set()

    async def _recover(self, endpoint: Endpoint) -> None:
        try:
            if await self.recover(endpoint):
                log.warning("server %s is back", endpoint.url)
                self.mark_up(endpoint)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this server cannot come back; the run ends if it was the last
            if self.any_up:
                log.error("server %s stays out of the pool: %s", endpoint.url, exc)
            else:
                self.fatal = exc
                self._changed.set()
        finally:
            self._recoveries.pop(endpoint, None)

    async def close(self) -> None:
        for task in list(self._recoveries.values()):
            task.cancel()
        for task in list(self._recoveries.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def backoff_s(attempt: int, *, base_s: float = 1.0, cap_s: float = 60.0) -> float:
    """Exponential backoff with full jitter for attempt 1, 2, ..."""
    return random.uniform(0, min(cap_s, base_s * 2 ** (attempt - 1)))
