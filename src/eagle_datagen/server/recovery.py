"""Bringing a server that went down back into the pool, and proving it is the same server.

A managed server is waited for (or restarted); an attached one is probed until it answers. Either way
it is used again only after it passed the run's :class:`~eagle_datagen.server.facts.FactsCheck` once
more: a server that came back serving another model, another vocabulary, with a reasoning parser or
with sampling defaults that change outputs stays out of the pool (the pool says so, and the run stops
if it was the last one).
"""

from __future__ import annotations

import httpx

from eagle_datagen.errors import ServerError
from eagle_datagen.generate.pool import Endpoint, Recover
from eagle_datagen.generate.transport import Transport
from eagle_datagen.server.facts import FactsCheck, read_server_facts, wait_until_healthy
from eagle_datagen.server.launcher import ManagedServer

#: How long a managed server that is still running may take to answer again before it is restarted.
MANAGED_HEALTH_WAIT_S = 60.0


def make_recover(
    http: httpx.AsyncClient,
    managed: ManagedServer | None,
    transport: Transport,
    check: FactsCheck,
    *,
    outage_give_up_s: float,
) -> Recover:
    """The pool's recovery: back up (health, or a restart), then the facts check; raises to keep it out."""

    async def recover(endpoint: Endpoint) -> bool:
        transport.drop(endpoint.url)  # keep-alive connections to a dead server are dead too
        if managed is not None:
            if not (
                managed.alive() and await wait_until_healthy(http, endpoint.url, give_up_after_s=MANAGED_HEALTH_WAIT_S)
            ):
                await managed.restart(http)
        elif not await wait_until_healthy(http, endpoint.url, give_up_after_s=outage_give_up_s):
            raise ServerError(
                f"{endpoint.url} has been unreachable for {outage_give_up_s:.0f} s; continue later with "
                "`eagle-datagen resume`"
            )
        facts = await read_server_facts(http, endpoint.url)
        check.check(facts, recovered=True)
        endpoint.max_running_requests = facts.max_running_requests
        endpoint.max_req_input_len = facts.max_req_input_len
        return True

    return recover
