"""Render parity: the client's template render against the server's own (``/v1/tokenize``).

A client-side render is only as good as its agreement with what the serving stack renders. Before any
``/generate`` request the run renders a sample of its rows both ways (:func:`sample_rows`: the first rows,
plus the first row of every shape present, so tools, tool calls, tool results, multi-turn history, system
prompts and text parts are all covered) and stops on the first difference, showing where and which tokens
(:func:`describe_difference`). ``verify-shard --server-url`` compares every stored prompt the same way.
"""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_datagen.errors import BadInputError, PreflightFailed
from eagle_datagen.inputs.prompts import PromptReader, PromptRow
from eagle_datagen.inputs.render import Rendered, Renderer
from eagle_datagen.inputs.sources import PromptSource
from eagle_datagen.server.tokenize import NoTokenizeEndpoint, ServerRenderer

#: Rows scanned for shapes beyond the first ``n`` (a huge file is not read whole for a preflight).
SCAN_LIMIT = 20_000
CONTEXT_TOKENS = 6
PARITY_FIX = (
    "make the server render as the tokenizer does (start it without a different --chat-template, with the "
    "same tokenizer files), or pass --render server to render every prompt through the server, or "
    "--no-render-parity to skip this check"
)


def row_shapes(row: PromptRow) -> set[str]:
    """The shapes a row has, for covering each of them in the sample."""
    shapes: set[str] = set()
    roles = [m["role"] for m in row.messages]
    if row.tools:
        shapes.add("tools")
    if any(m.get("tool_calls") for m in row.messages):
        shapes.add("tool_calls")
    if roles and roles[-1] == "tool":
        shapes.add("tool_result_end")
    if "system" in roles:
        shapes.add("system")
    if roles.count("user") > 1 or "assistant" in roles:
        shapes.add("multi_turn")
    if any(isinstance(m.get("content"), list) for m in row.messages):
        shapes.add("text_parts")
    if any(m.get("reasoning_content") for m in row.messages):
        shapes.add("reasoning_history")
    return shapes or {"single_turn"}


def sample_rows(source: Path | PromptSource, n: int, *, scan_limit: int = SCAN_LIMIT) -> list[PromptRow]:
    """Up to ``n`` rows: the first row of each shape within the first ``scan_limit`` rows, then the first rows.

    Bad rows are passed over (the run itself reports them, with their line)."""
    first_of: dict[str, PromptRow] = {}
    head: list[PromptRow] = []
    if isinstance(source, Path):
        reader = PromptReader(source, on_bad=lambda exc: None)
    else:
        reader = PromptReader(source.path, on_bad=lambda exc: None, columns=source.columns)
    for index, row in enumerate(reader):
        if index >= scan_limit:
            break
        for shape in row_shapes(row):
            first_of.setdefault(shape, row)
        if len(head) < n:
            head.append(row)
    chosen: dict[int, PromptRow] = {}
    for row in sorted(first_of.values(), key=lambda r: r.line):
        chosen.setdefault(row.line, row)
    for row in head:
        if len(chosen) >= n:
            break
        chosen.setdefault(row.line, row)
    return sorted(chosen.values(), key=lambda r: r.line)[: max(n, len(first_of))]


def describe_difference(tokenizer: Any, client: Sequence[int], server: Sequence[int]) -> str:
    """Where two renders part, with both tokens decoded and a little context before."""
    at = next((i for i, (a, b) in enumerate(zip(client, server, strict=False)) if a != b), None)
    if at is None:
        at = min(len(client), len(server))
    before = tokenizer.decode(list(client[max(0, at - CONTEXT_TOKENS) : at]))

    def token(ids: Sequence[int]) -> str:
        if at >= len(ids):
            return "(end of prompt)"
        return f"{ids[at]} {tokenizer.decode([ids[at]])!r}, then {tokenizer.decode(list(ids[at + 1 : at + 1 + CONTEXT_TOKENS]))!r}"

    return (
        f"they differ at position {at} ({len(client)} ids here, {len(server)} on the server), after {before!r}:\n"
        f"      client: {token(client)}\n"
        f"      server: {token(server)}"
    )


@dataclass
class ParityResult:
    """What one parity check found (it raises on a difference)."""

    url: str
    compared: int = 0
    #: Rows the server's chat path refused while the client's template rendered them: (line, message).
    refused: list[tuple[int, str]] = field(default_factory=list)
    #: Rows the client's template refused (the run reports them as bad rows).
    client_bad: int = 0


def check_parity(
    renderer: Renderer,
    server: ServerRenderer,
    rows: Sequence[PromptRow],
    path: str,
) -> ParityResult:
    """Renders ``rows`` both ways; raises :class:`PreflightFailed` on the first difference."""
    result = ParityResult(server.url)
    client = renderer.render_many(rows, path)
    served = server.render_many(rows, path)
    for row, mine, theirs in zip(rows, client, served, strict=True):
        if isinstance(mine, BadInputError):
            result.client_bad += 1
            continue
        if isinstance(theirs, BadInputError):
            result.refused.append((row.line, theirs.detail))
            continue
        if mine != theirs:
            raise PreflightFailed(
                f"render parity: {path}:{row.line} renders differently here and on {server.url} "
                f"(POST {'/v1/tokenize'}); {describe_difference(renderer.tokenizer, mine, theirs)}\n"
                f"  Records would hold prompts the served model never sees. Fix: {PARITY_FIX}"
            )
        result.compared += 1
    if result.refused and result.compared == 0:
        line, message = result.refused[0]
        raise PreflightFailed(
            f"render parity: {server.url} refused every sampled row that renders here (e.g. {path}:{line}: "
            f"{message}); fix: {PARITY_FIX}"
        )
    return result


class ParityRenderer:
    """For ``verify-shard --server-url``: renders rows with the client and through the server, and hands back
    the client's ids where both agree; a row they render differently becomes a :class:`BadInputError` whose
    message shows where (verify reports it as a ``render_error`` of that record). Rows the server's chat path
    refuses keep the client's ids and are counted in :attr:`refused`."""

    def __init__(self, client: Renderer, server: ServerRenderer) -> None:
        self.client = client
        self.server = server
        self.refused: list[tuple[int, str]] = []
        today = datetime.date.today()
        self.compare_with = client
        if client.traits.date_dependent and client.render_date not in (None, today):  # the server's clock
            self.compare_with = Renderer(client.tokenizer, client.template_kwargs, render_date=today)

    def render_many(self, rows: Sequence[PromptRow], path: str = "<prompts>") -> list[Rendered]:
        client = self.client.render_many(rows, path)
        compare = client if self.compare_with is self.client else self.compare_with.render_many(rows, path)
        served = self.server.render_many(rows, path)
        out: list[Rendered] = []
        for row, mine, ours, theirs in zip(rows, client, compare, served, strict=True):
            if isinstance(theirs, BadInputError) and not isinstance(mine, BadInputError):
                self.refused.append((row.line, theirs.detail))
            elif isinstance(ours, list) and isinstance(theirs, list) and ours != theirs:
                mine = BadInputError(
                    path, row.line, "render_parity",
                    f"render parity: {self.server.url} renders it differently; "
                    + _one_line(describe_difference(self.client.tokenizer, ours, theirs)),
                    PARITY_FIX,
                )  # fmt: skip
            out.append(mine)
        return out


def _one_line(text: str) -> str:
    return text.replace(":\n      ", ": ").replace("\n      ", "; ")


def preflight_parity(
    renderer: Renderer,
    urls: Sequence[str],
    *,
    source: Path | PromptSource,
    rows: int,
    api_key: str | None,
    echo: Callable[[str], None],
    tls: ssl.SSLContext | None = None,
) -> list[ParityResult]:
    """The run's preflight: a sample of ``rows`` rows against each server; prints what it proved."""
    prompts = source if isinstance(source, Path) else source.path
    sample = sample_rows(source, rows)
    if not sample:
        return []
    today = datetime.date.today()
    if renderer.traits.date_dependent and renderer.render_date not in (None, today):
        echo(
            f"  note: the template prints the date; parity is checked with today's ({today}), the server's, "
            f"while the prompts keep the date pinned at run ({renderer.render_date})"
        )
        renderer = Renderer(renderer.tokenizer, renderer.template_kwargs, render_date=today)
    shapes = sorted(set().union(*(row_shapes(r) for r in sample)))
    results = []
    for url in urls:
        with ServerRenderer(url, api_key=api_key, template_kwargs=renderer.template_kwargs, tls=tls) as server:
            try:
                result = check_parity(renderer, server, sample, str(prompts))
            except NoTokenizeEndpoint as exc:
                echo(f"  warning: render parity not checked: {exc} (--no-render-parity skips the check)")
                continue
        results.append(result)
        echo(
            f"  render parity with {url}: {result.compared} sampled rows render identically "
            f"(shapes: {', '.join(shapes)})"
        )
        if result.refused:
            line, message = result.refused[0]
            echo(
                f"  warning: {url}'s chat path refuses {len(result.refused)} of the sampled rows that the "
                f"template renders here (e.g. {prompts}:{line}: {message}); served traffic could not send them, "
                "their records hold the template's own render"
            )
    return results
