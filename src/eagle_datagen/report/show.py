"""``eagle-datagen show``: one record as a person reads it.

The prompt decoded with its special tokens marked ``⟦<|im_end|>⟧``, then the output split where the ids
split it: reasoning, the think-close, the answer, a tool call, the stop id, each headed by its id range, plus
the finish reason and the loss-mask boundary an export uses (``prompt_len``: ids before it are masked).
The split is :func:`eagle_datagen.report.stats.split_output`, the rule ``stats`` counts with. Colors come
from click styles, which ``click.echo`` drops when the output is not a terminal.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import orjson

from eagle_datagen.errors import UsageError
from eagle_datagen.report.markers import Markers, run_markers
from eagle_datagen.report.stats import open_run, shard_files, split_output
from eagle_datagen.store.shards import record_id

#: ``--where`` fields and how each reads its value from a record.
WHERE_FIELDS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "finish": lambda r: (r.get("finish_reason") or {}).get("type"),
    "variant": lambda r: r.get("variant"),
    "server": lambda r: r.get("server"),
    "turn": lambda r: r.get("turn", 0),
    "key": lambda r: r.get("key"),
    "sample": lambda r: r.get("sample"),
    "conversation": lambda r: r.get("conversation"),
    "end": lambda r: r.get("end") if "turn" in r else None,
}
OPEN_MARK, CLOSE_MARK = "⟦", "⟧"


@dataclass(frozen=True)
class Located:
    """A record and where it lies."""

    record: dict[str, Any]
    path: str
    line: int


def parse_where(items: Sequence[str]) -> list[tuple[str, str]]:
    """``finish=length`` → ``("finish", "length")``; refuses an unknown field, naming the known ones."""
    parsed = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in WHERE_FIELDS:
            raise UsageError(
                f"--where {item!r}: give FIELD=VALUE with FIELD one of {', '.join(WHERE_FIELDS)} "
                "(e.g. --where finish=length)"
            )
        parsed.append((name, value))
    return parsed


def _matches(record: dict[str, Any], where: list[tuple[str, str]]) -> bool:
    return all(str(WHERE_FIELDS[name](record)) == value for name, value in where)


def _records(run_dir: Path) -> Iterator[tuple[str, int, bytes]]:
    for path, _ in shard_files(run_dir):
        with path.open("rb") as handle:
            for line, raw in enumerate(handle, start=1):
                if raw.endswith(b"\n"):
                    yield f"shards/{path.name}", line, raw


def select(
    run_dir: Path, *, record: str | None, where: list[tuple[str, str]], random_n: int | None, seed: int, limit: int
) -> list[Located]:
    """The records to show: one by id, ``random_n`` drawn uniformly (reservoir, ``seed``), else the first ``limit``;
    all among those matching ``where``."""
    chosen: list[Located] = []
    rng = random.Random(seed)
    seen = 0
    for path, line, raw in _records(run_dir):
        if record is not None and record_id(raw) != record:
            continue
        data = orjson.loads(raw)
        if not _matches(data, where):
            continue
        found = Located(data, path, line)
        if record is not None:
            return [found]
        seen += 1
        if random_n is None:
            chosen.append(found)
            if len(chosen) >= limit:
                break
        elif len(chosen) < random_n:
            chosen.append(found)
        else:
            slot = rng.randrange(seen)
            if slot < random_n:
                chosen[slot] = found
    if record is not None:
        raise UsageError(f"no record with id {record!r} in {run_dir / 'shards'}")
    if not chosen:
        condition = " and ".join(f"{k}={v}" for k, v in where) or "any"
        raise UsageError(f"no record in {run_dir / 'shards'} matches {condition}")
    return chosen


class Decoder:
    """Decodes ids to text, special ids as ``⟦name⟧`` (styled), runs of ordinary ids in one decode call."""

    def __init__(self, tokenizer: Any, markers: Markers) -> None:
        self.tokenizer = tokenizer
        special: dict[int, str] = dict(markers.special)
        for tid, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            special[int(tid)] = str(getattr(token, "content", token))
        self.special = special

    def text(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        run: list[int] = []
        for tid in ids:
            if tid in self.special:
                if run:
                    parts.append(self._decode(run))
                    run = []
                parts.append(click.style(f"{OPEN_MARK}{self.special[tid]}{CLOSE_MARK}", fg="cyan", bold=True))
            else:
                run.append(tid)
        if run:
            parts.append(self._decode(run))
        return "".join(parts)

    def name(self, tid: int) -> str:
        return self.special.get(tid) or self._decode([tid])

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _head(title: str, color: str) -> str:
    return click.style(f"── {title} ──", fg=color, bold=True)


def _reply_lines(reply: dict[str, Any]) -> list[str]:
    """A turn's parsed reply (the next turn's history message), in short."""

    def short(text: Any, n: int = 120) -> str:
        value = str(text or "").replace("\n", "\\n")
        return repr(value if len(value) <= n else value[:n] + "…")

    lines = [f"reply (as the parsers split it, the next turn's history): content {short(reply.get('content'))}"]
    if "reasoning_content" in reply:
        lines.append(f"  reasoning_content {len(str(reply['reasoning_content'] or '')):,} chars: "
                     f"{short(reply['reasoning_content'], 80)}")  # fmt: skip
    for call in reply.get("tool_calls") or []:
        function = call.get("function") or {}
        lines.append(f"  tool call {call.get('id')}: {function.get('name')}({short(function.get('arguments'), 80)})")
    return lines


def render(found: Located, decoder: Decoder, markers: Markers) -> list[str]:
    """The lines that show one record."""
    r = found.record
    prompt, output = r["prompt_ids"], r["output_ids"]
    finish = r.get("finish_reason") or {}
    kind = finish.get("type")
    matched = finish.get("matched")
    ends_on_stop = kind == "stop" and type(matched) is int and bool(output) and output[-1] == matched
    close = markers.think_close
    close_at = output.index(close) if close is not None and close in output else None
    tool_at = min((output.index(t) for t in markers.tool_calls if t in output), default=None)
    shape = split_output(
        len(output), close_at, tool_at, opens_reasoning=markers.prompt_opens_reasoning(prompt[-4:]),
        ends_on_stop_id=ends_on_stop,
    )  # fmt: skip
    finish_text = str(kind)
    if type(matched) is int:
        finish_text += f" (matched id {matched} {OPEN_MARK}{decoder.name(matched)}{CLOSE_MARK})"
    lines = [
        click.style(f"record {r.get('id')}", bold=True) + f"  key {r.get('key')!r} sample {r.get('sample')}  "
        f"{found.path}:{found.line}",
        f"finish: {finish_text}; output {len(output):,} ids (completion_tokens {r.get('completion_tokens')})",
    ]
    if "variant" in r:
        lines.append(
            f"variant: {r['variant']}; template kwargs {orjson.dumps(r.get('chat_template_kwargs', {})).decode()}; "
            f"sampling {orjson.dumps(r.get('sampling_params', {})).decode()}"
        )
    if "turn" in r:  # --turns all: where the turn stands in its conversation, and its parsed reply
        end = r.get("end")
        lines.append(
            f"turn {r['turn']} of conversation {r.get('conversation')!r}; "
            + (f"the conversation ends here: {end}" if end else "the conversation goes on")
            + (f" ({r['end_detail']})" if r.get("end_detail") else "")
            + f"; rendered from {len(r.get('messages') or [])} messages"
        )
        lines.extend(_reply_lines(r.get("reply") or {}))
    if isinstance(r.get("started"), (int, float)) and isinstance(r.get("finished"), (int, float)):
        lines.append(f"server: {r.get('server')}; {r['finished'] - r['started']:.3f} s")
    lines.append(
        f"loss mask: prompt_len {len(prompt):,}: an export masks ids [0, {len(prompt):,}) and trains on "
        f"[{len(prompt):,}, {len(prompt) + len(output):,})"
    )
    lines.append(_head(f"prompt: {len(prompt):,} ids", "blue"))
    lines.append(decoder.text(prompt))
    start = 0
    if shape.reasoning:
        lines.append(_head(f"reasoning: output[0:{shape.reasoning}] ({shape.reasoning:,} ids)", "magenta"))
        lines.append(decoder.text(output[: shape.reasoning]))
        start = shape.reasoning
    if close_at is not None:
        lines.append(_head(f"think-close: output[{close_at}] = {close}", "magenta"))
        start = close_at + 1
    end = len(output) - (1 if ends_on_stop else 0)
    answer_end = tool_at if shape.tool_call and tool_at is not None else end
    lines.append(_head(f"answer: output[{start}:{answer_end}] ({max(0, answer_end - start):,} ids)", "green"))
    lines.append(decoder.text(output[start:answer_end]) if answer_end > start else click.style("(empty)", dim=True))
    if shape.tool_call and tool_at is not None:
        lines.append(_head(f"tool call: output[{tool_at}:{end}] ({end - tool_at:,} ids)", "yellow"))
        lines.append(decoder.text(output[tool_at:end]))
    if ends_on_stop:
        lines.append(
            _head(f"stop: output[{end}] = {output[-1]} {OPEN_MARK}{decoder.name(output[-1])}{CLOSE_MARK}", "red")
        )
    elif kind == "length":
        lines.append(_head(f"cut at max_new_tokens: {len(output):,} ids, no stop id", "red"))
    return lines


def show_command(
    run_dir: Path,
    *,
    record: str | None,
    random_n: int | None,
    where: Sequence[str],
    seed: int,
    limit: int,
    tokenizer: Path | None,
    trust_remote_code: bool,
    color: bool | None,
) -> int:
    """``eagle-datagen show``: prints the chosen records."""
    from eagle_datagen.inputs.render import load_tokenizer

    manifest = open_run(run_dir)
    conditions = parse_where(where)
    if tokenizer is None:
        pinned = (manifest.plan.get("tokenizer") or {}).get("path")
        tokenizer = Path(pinned) if isinstance(pinned, str) else None
    if tokenizer is None or not tokenizer.exists():
        raise UsageError(f"the run's tokenizer {tokenizer} is not here; pass --tokenizer DIR to decode the ids")
    markers = run_markers(manifest.plan, manifest.facts, tokenizer)
    decoder = Decoder(load_tokenizer(tokenizer, trust_remote_code=trust_remote_code), markers)
    chosen = select(run_dir, record=record, where=conditions, random_n=random_n, seed=seed, limit=limit)
    for i, found in enumerate(chosen):
        if i:
            click.echo("", color=color)
        for line in render(found, decoder, markers):
            click.echo(line, color=color)
    return 0
