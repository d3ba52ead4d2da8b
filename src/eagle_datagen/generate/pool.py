"""The servers a run sends to, and which of them are usable right now.

Work goes to the healthy server with the fewest requests in flight. A server that fails
``down_after`` requests in a row (connection errors, timeouts, 5xx) is taken out of the pool; its
in-flight requests are cancelled and requeued, and a recovery task (a health probe with backoff,
or a restart for a managed server) brings it back. While no server is up, dispatch waits instead
of burning every prompt's retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: Brings a down endpoint back; returns True when it is usable again.
Recover = Callable[["Endpoint"], Awaitable[bool]]


@dataclass(eq=False)
class Endpoint:
    """One server URL and its live counters."""

    url: str
    max_running_requests: int | None = None
    max_req_input_len: int | None = None
    up: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    completed: int = 0
    downs: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    last_progress: float = field(default_factory=time.monotonic)


class ServerPool:
    """Picks endpoints, tracks failures, and runs recovery for endpoints that went down."""

    def __init__(self, endpoints: list[Endpoint], recover: Recover, *, down_after: int = 5) -> None:
        if not endpoints:
            raise ValueError("a pool needs at least one endpoint")
        self.endpoints = endpoints
        self.recover = recover
        self.down_after = down_after
        self._changed = asyncio.Event()
        self._recoveries: dict[Endpoint, asyncio.Task[None]] = {}
        self.fatal: BaseException | None = None

    @property
    def any_up(self) -> bool:
        return any(e.up for e in self.endpoints)

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    async def acquire(self) -> Endpoint:
        """The up endpoint with the fewest requests in flight; waits while none is up."""
        while True:
            if self.fatal is not None:
                raise self.fatal
            candidates = [e for e in self.endpoints if e.up]
            if candidates:
                low = min(e.in_flight for e in candidates)
                endpoint = random.choice([e for e in candidates if e.in_flight == low])
                endpoint.in_flight += 1
                return endpoint
            self._changed.clear()
            await self._changed.wait()

    def release(self, endpoint: Endpoint) -> None:
        endpoint.in_flight -= 1

    def succeeded(self, endpoint: Endpoint) -> None:
        endpoint.consecutive_failures = 0
        endpoint.completed += 1
        endpoint.last_progress = time.monotonic()

    def failed(self, endpoint: Endpoint) -> bool:
        """Counts a transient failure; returns True when the endpoint is (now) down."""
        if not endpoint.up:
            return True
        endpoint.consecutive_failures += 1
        if endpoint.consecutive_failures >= self.down_after:
            self.mark_down(endpoint, f"{endpoint.consecutive_failures} failures in a row")
            return True
        return False

    def mark_down(self, endpoint: Endpoint, reason: str) -> None:
        """Takes ``endpoint`` out of the pool, cancels its requests (they are requeued), recovers it."""
        if not endpoint.up:
            return
        endpoint.up = False
        endpoint.downs += 1
        log.warning("server %s is down (%s); its requests go back to the queue", endpoint.url, reason)
        for task in list(endpoint.tasks):
            task.cancel()
        self._recoveries[endpoint] = asyncio.create_task(self._recover(endpoint))

    def mark_up(self, endpoint: Endpoint) -> None:
        endpoint.up = True
        endpoint.consecutive_failures = 0
        endpoint.last_progress = time.monotonic()
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
