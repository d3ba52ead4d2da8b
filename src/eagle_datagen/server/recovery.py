"""Bringing a server that went down back into the pool, and proving it is the same server.

A managed server is waited for (or restarted); an attached one is probed until it answers. Either way
it is used again only after it passed the run's :class:`~eagle_datagen.server.facts.FactsCheck` once
more: a server that came back serving another model, another vocabulary, with a reasoning parser or
with sampling defaults that change outputs stays out of the pool (the pool says so, and the run stops
if it was the last one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from eagle_datagen.errors import ServerError
from eagle_datagen.generate.pool import Endpoint, Recover, backoff_s
from eagle_datagen.generate.transport import Transport
from eagle_datagen.server.facts import FactsCheck, ServerFacts, read_server_facts, wait_until_healthy
from eagle_datagen.server.launcher import ManagedServer, describe_exit

#: How long a managed server that is still running may take to answer again before it is restarted.
MANAGED_HEALTH_WAIT_S = 60.0
#: Reads of /server_info and /model_info after the health check answers, before the server counts as down again.
FACTS_TRIES = 5


def make_recover(
    http: httpx.AsyncClient,
    managed: ManagedServer | None,
    transport: Transport,
    check: FactsCheck,
    *,
    outage_give_up_s: float,
) -> Recover:
    """The pool's recovery: back up (health, or a restart), then the facts check; raises to keep it out."""

    async def back_up(endpoint: Endpoint, restart: bool) -> None:
        """Until ``endpoint`` answers its health check: a launched server is waited for while its process
        lives, else restarted; an attached one is probed until ``outage_give_up_s``."""
        if managed is not None:
            alive = managed.alive
            if restart or not await wait_until_healthy(
                http, endpoint.url, give_up_after_s=MANAGED_HEALTH_WAIT_S, alive=alive
            ):
                # a crash explained by the request that ran alone (now set aside) does not use up --max-restarts
                await managed.restart(http, charged=not endpoint.crash_explained)
                endpoint.crash_explained = False
        elif not await wait_until_healthy(http, endpoint.url, give_up_after_s=outage_give_up_s):
            raise ServerError(
                f"{endpoint.url} has been unreachable for {outage_give_up_s:.0f} s; continue later with "
                "`eagle-datagen resume`"
            )

    async def facts_of(endpoint: Endpoint) -> ServerFacts | None:
        """The server's facts, complete (a /model_info that does not answer yet is retried); None: down again."""
        reference = check.reference
        for attempt in range(1, FACTS_TRIES + 1):
            try:
                facts = await read_server_facts(http, endpoint.url)
            except ServerError:
                facts = None
            if facts is not None and (facts.complete or reference is None or not reference.complete):
                return facts
            await asyncio.sleep(backoff_s(attempt, base_s=0.5, cap_s=5.0))
        return facts

    async def recover(endpoint: Endpoint) -> bool:
        transport.drop(endpoint.url)  # keep-alive connections to a dead server are dead too
        restart = False
        while True:
            await back_up(endpoint, restart)
            facts = await facts_of(endpoint)
            if facts is not None:
                break
            restart = managed is not None and not managed.alive()  # it went down again: wait (or restart) again
        check.check(facts, recovered=True)
        endpoint.max_running_requests = facts.max_running_requests
        endpoint.max_req_input_len = facts.max_req_input_len
        return True

    return recover


def exited(managed: ManagedServer | None) -> Callable[[Endpoint], str | None] | None:
    """For the pool: why the launched server's process is gone (then one failed request means down), else None."""
    if managed is None:
        return None

    def why(endpoint: Endpoint) -> str | None:
        if managed.alive():
            return None
        code = managed.process.returncode if managed.process is not None else None
        return f"its process ended ({describe_exit(code)})" if code is not None else "its process is gone"

    return why
