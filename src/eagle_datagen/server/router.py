"""SGLang's router (``sglang-router``, measured on 0.3.2) in front of SGLang workers.

What the router does, measured (``../shared/docs/sglang-router.md``, and ``tests/test_router.py`` against the real
router), and what we do about it:

* It answers ``/workers`` with its workers (``{"workers": [{"url": …, "metadata": …}, …]}``), its own
  ``/get_server_info`` (``router_manager: true``) and a 404 on ``/server_info``: :func:`router_worker_urls`
  detects a router by ``/workers``, and :func:`read_router_facts` reads ``/server_info`` and ``/model_info``
  from **each worker URL** (they must agree on every fact that changes the ids, and each is checked like a
  directly attached server).
* It rebuilds ``/generate`` rather than passing it on: of ``sampling_params`` it keeps only
  :data:`ROUTER_KEPT_SAMPLING` and drops any other key without an error. :func:`check_router_passes` refuses a
  plan with a key it would drop (``sampling_seed``, ``frequency_penalty``, …): a lost setting is a silently wrong
  dataset. ``input_ids`` and ``rid`` are passed on; ``output_ids`` and ``meta_info`` come back unchanged.
* ``--launch-router`` runs ``python -m sglang_router.launch_router --worker-urls …`` as a managed child:
  :class:`ManagedRouter` is a :class:`~eagle_datagen.server.launcher.ManagedServer` with another command and
  readiness probe, so it has the same guarantees (own process group, log file, readiness while alive, reaper,
  stop on every exit path).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from eagle_datagen.config import LaunchConfig, RouterConfig
from eagle_datagen.errors import ServerError, UsageError
from eagle_datagen.server.facts import ServerFacts, read_server_facts
from eagle_datagen.server.launcher import ManagedServer

#: ``sampling_params`` keys sglang-router 0.3.2 passes on to the worker; it drops every other key.
ROUTER_KEPT_SAMPLING = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "skip_special_tokens",
        "no_stop_trim",
    }
)
#: Worker facts that must agree across a router's workers (they change the ids, or what we check).
#: Not ``random_seed``: SGLang draws one per server when none is given, and a sampled record is the model's
#: own output whichever seed a server has (greedy ignores it); our own pool does not ask for it either.
MUST_AGREE = (
    "model_path",
    "vocab_size",
    "weight_version",
    "tokenizer_path",
    "served_model_name",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "reasoning_parser",
    "preferred_sampling_params",
    "sampling_defaults",
    "enable_deterministic_inference",
    "speculative_algorithm",
)


async def router_worker_urls(http: httpx.AsyncClient, url: str) -> list[str] | None:
    """The worker URLs when ``url`` is an sglang-router (its ``/workers`` lists them), else ``None``."""
    try:
        response = await http.get(f"{url}/workers")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        payload = response.json()
    except ValueError:
        return None
    workers = payload.get("workers") if isinstance(payload, dict) else None
    if not isinstance(workers, list):
        return None
    urls = [w["url"].rstrip("/") for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]
    if not urls:
        raise ServerError(
            f"{url} is an sglang-router with no workers (a router that has just started may still be registering "
            "them); add workers to it, or attach to the workers directly with --server-url"
        )
    return urls


async def router_worker_urls_or_empty(http: httpx.AsyncClient, url: str) -> list[str]:
    try:
        return await router_worker_urls(http, url) or []
    except ServerError:
        return []


async def read_router_facts(http: httpx.AsyncClient, url: str, worker_urls: list[str]) -> ServerFacts:
    """The facts of a router: each worker's, read from the worker itself, which must all agree.

    The router's ``max_running_requests`` is the workers' sum and its ``max_req_input_len`` their minimum.
    """
    workers: list[ServerFacts] = []
    for worker in worker_urls:
        try:
            workers.append(await read_server_facts(http, worker))
        except ServerError as exc:
            raise ServerError(
                f"{url} is an sglang-router; its worker {worker} cannot be read ({exc}). Its facts (model, "
                "vocabulary, reasoning parser, input limit) must be checked: make the workers reachable from here, "
                "or attach to them directly with --server-url"
            ) from None
    first = workers[0]
    for other in workers[1:]:
        for name in ("version", *MUST_AGREE):
            a, b = _fact(first, name), _fact(other, name)
            if a != b:
                raise ServerError(
                    f"the workers of the sglang-router at {url} differ in {name}: {first.url} has {a!r}, "
                    f"{other.url} has {b!r}. Every record must come from the same model and settings: put only "
                    "identical workers behind the router"
                )
    running = [w.max_running_requests for w in workers if w.max_running_requests is not None]
    limits = [w.max_req_input_len for w in workers if w.max_req_input_len is not None]
    return replace(
        first,
        url=url,
        max_running_requests=sum(running) if len(running) == len(workers) else None,
        max_req_input_len=min(limits) if limits else None,
        workers=tuple(w.url for w in workers),
    )


def _fact(facts: ServerFacts, name: str) -> Any:
    if name in {f for f in ServerFacts.__dataclass_fields__ if f not in ("url", "args", "workers")}:
        return getattr(facts, name)
    return facts.args.get(name)


def check_router_passes(router_url: str, worker_urls: tuple[str, ...], sampling_params: dict[str, Any]) -> None:
    """Refuses ``sampling_params`` keys the router would drop without a word."""
    dropped = sorted(set(sampling_params) - ROUTER_KEPT_SAMPLING)
    if dropped:
        direct = " ".join(f"--server-url {w}" for w in worker_urls)
        raise UsageError(
            f"{router_url} is an sglang-router, which drops the sampling_params {', '.join(dropped)} from /generate "
            f"(sglang-router 0.3.2 rebuilds the request and keeps only {', '.join(sorted(ROUTER_KEPT_SAMPLING))}); "
            f"the records would be made without them. Attach to the workers instead: {direct}"
        )


class ManagedRouter(ManagedServer):
    """``sglang_router.launch_router`` over running workers, with :class:`ManagedServer`'s lifecycle."""

    what = "sglang-router"
    ready_path = "/health"

    def __init__(self, config: RouterConfig, log_path: Path, *, api_key: str | None = None) -> None:
        self.router = config
        # The process side of ManagedServer (port, host, python, start-up timeout) is all it reads of this.
        process = LaunchConfig(
            model=Path("sglang-router"),
            server_python=config.python,
            host=config.host,
            port=config.port,
            startup_timeout_s=config.startup_timeout_s,
            max_restarts=3,
        )
        super().__init__(process, log_path, api_key=api_key)
        from eagle_datagen.server.launcher import free_port

        self.prometheus_port = config.prometheus_port or free_port(config.host)

    @property
    def command(self) -> list[str]:
        command = [
            self.router.python,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *self.router.worker_urls,
            "--policy",
            self.router.policy,
            "--host",
            self.config.host,
            "--port",
            str(self.port),
            # Two routers on one machine clash on the default metrics port: always a free one.
            "--prometheus-port",
            str(self.prometheus_port),
        ]
        if self.api_key:
            command += ["--api-key", self.api_key]
        return command + list(self.router.router_args)

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        """Healthy is not ready: the router answers ``/health`` before it has registered its workers (it tries
        gRPC on each first; measured with real SGLang workers), so wait until ``/workers`` lists them all."""
        await super().wait_ready(http)
        wanted = {u.rstrip("/") for u in self.router.worker_urls}
        deadline = self.started_at + self.config.startup_timeout_s
        while True:
            listed = set(await router_worker_urls_or_empty(http, self.url))
            if wanted <= listed and self.alive():
                return
            if not self.alive():
                raise ServerError(
                    f"the {self.what} exited during start-up. Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(wanted - listed))
                raise ServerError(
                    f"the {self.what} did not register {missing} within {self.config.startup_timeout_s:.0f} s; are "
                    f"they up and reachable from it? Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.5)

    def _hint(self) -> str:
        tail = self.log_tail()
        if "No module named sglang_router" in tail or "No module named 'sglang_router'" in tail:
            return (
                f"\nsglang-router is not installed for {self.router.python}: pip install sglang-router there, or "
                "point --router-python at the Python that has it"
            )
        return super()._hint()
