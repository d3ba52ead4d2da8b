"""The live progress bar and the end-of-run summary."""

from __future__ import annotations

import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from eagle_datagen.generate.pipeline import Stats
from eagle_datagen.generate.pool import ServerPool
from eagle_datagen.inputs.prompts import ReadStats
from eagle_datagen.store.logs import FAILURES_NAME

REFRESH_S = 0.5


class Progress:
    """A tqdm bar: prompts done/total, output tok/s, in flight, failures. Silent when disabled."""

    def __init__(self, stats: Stats, pool: ServerPool, *, total: int, enabled: bool) -> None:
        self.stats = stats
        self.pool = pool
        self._last = 0.0
        self._shown = 0
        self._total = total
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total or None, unit="req", dynamic_ncols=True, file=sys.stderr, smoothing=0.05)

    def update(self) -> None:
        if self.bar is None:
            return
        now = time.monotonic()
        if now - self._last < REFRESH_S:
            return
        self._last = now
        done = self.stats.records + self.stats.failures
        if self.stats.turns_not_sent and self._total:  # --turns all: conversations that ended early
            self.bar.total = max(done, self._total - self.stats.turns_not_sent)
        self.bar.update(done - self._shown)
        self._shown = done
        elapsed = max(now - self.stats.started, 1e-9)
        self.bar.set_postfix(
            {
                "tok/s": f"{self.stats.output_tokens / elapsed:,.0f}",
                "in_flight": self.pool.in_flight,
                "failed": self.stats.failures,
            },
            refresh=False,
        )

    def close(self) -> None:
        if self.bar is not None:
            self._last = 0.0
            self.update()
            self.bar.close()


def format_summary(
    stats: Stats,
    read: ReadStats,
    *,
    store_total: int,
    out_dir: Path,
    wall_s: float,
    samples: int = 1,
    unresolved: Counter[str] | None = None,
    interrupted: bool = False,
) -> str:
    """What the run did, in a few lines; the last says how many requests failed and where, if any did."""
    lines = [
        f"records written: {stats.records} this pass, {store_total} in {out_dir / 'shards'}",
        *stats.tally.summary_lines(),  # the same counters `eagle-datagen stats` prints
        f"failures: {stats.failures} (see failures.jsonl); retries: {stats.retries}; requeued after a server went down: {stats.requeued}",
        f"prompt rows: {read.rows} read, {read.bad + stats.rejects} set aside (rejects.jsonl), "
        f"{read.collapsed_duplicates} identical rows collapsed, {stats.already_done + read.done_skipped * samples} records already done",
        *(
            [
                f"record warnings (written, see docs/verify.md): {', '.join(f'{k} {v}' for k, v in sorted(stats.warnings.items()))}"
            ]
            if stats.warnings
            else []
        ),
        *([_conversations_line(stats)] if stats.ends or stats.conversations_failed else []),
        f"wall time: {wall_s:,.1f} s ({stats.output_tokens / max(wall_s, 1e-9):,.0f} output tok/s)",
    ]
    if unresolved:
        lines.append(format_failures(unresolved, out_dir, interrupted=interrupted))
    return "\n".join(lines)


def _conversations_line(stats: Stats) -> str:
    """``--turns all``: how this pass's conversations ended (conversations.jsonl has one line each)."""
    ends = stats.ends
    early = ", ".join(f"{k} {v}" for k, v in sorted(ends.items()) if k != "complete")
    line = f"conversations ended this pass: {sum(ends.values())} ({ends.get('complete', 0)} complete"
    line += f"; stopped early: {early})" if early else ")"
    if stats.conversations_failed:
        line += f"; {stats.conversations_failed} cut short by a failed turn (failures.jsonl; resume continues them)"
    return line + " (see conversations.jsonl)"


def format_failures(
    unresolved: Counter[str], out_dir: Path, *, kept_aside: bool = False, interrupted: bool = False
) -> str:
    """The line behind exit code 3: how many records failed, of which kinds, where, and what sends them again
    (``interrupted``: the run was stopped, so it exits 130 and ``resume`` also finishes the rest)."""
    kinds = ", ".join(f"{kind} {n}" for kind, n in unresolved.most_common())
    total = sum(unresolved.values())
    again = shlex.quote(str(out_dir))
    how = (
        f"eagle-datagen resume --out {again} --retry-failed sends them again"
        if kept_aside
        else f"eagle-datagen resume --out {again} sends them again"
    )
    if interrupted:
        return (
            f"stopped with {total} failed record(s) so far ({kinds}): see {out_dir / FAILURES_NAME}; "
            f"eagle-datagen resume --out {again} sends them again and finishes the rest"
        )
    return f"finished with {total} failed record(s) ({kinds}): see {out_dir / FAILURES_NAME}; {how} (exit code 3)"
