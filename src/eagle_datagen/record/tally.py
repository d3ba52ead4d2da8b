"""Counters over records: one implementation for the run's progress bar and summary and for ``stats``.

A :class:`Tally` is fed one record at a time (its output length, finish type, server and variant) by the
pipeline as responses are written, and by ``eagle-datagen stats`` as it streams finished shards, so the
counts a run prints at its end are the counts ``stats`` prints for the same records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

#: The key used in the counters for a record without a variant (a run without ``--mix``).
NO_VARIANT = "-"


@dataclass
class Tally:
    """Records, output tokens, the longest output, and counts by finish type, server and variant."""

    records: int = 0
    output_tokens: int = 0
    max_output: int = 0
    finish: Counter[str] = field(default_factory=Counter)
    servers: Counter[str] = field(default_factory=Counter)
    variants: Counter[str] = field(default_factory=Counter)

    def add(self, output_len: int, finish_type: str, *, server: str | None = None, variant: str | None = None) -> None:
        self.records += 1
        self.output_tokens += output_len
        if output_len > self.max_output:
            self.max_output = output_len
        self.finish[finish_type] += 1
        if server is not None:
            self.servers[server] += 1
        self.variants[variant if variant is not None else NO_VARIANT] += 1

    @property
    def hit_length(self) -> int:
        """Outputs that stopped at ``max_new_tokens`` (finish ``length``)."""
        return self.finish.get("length", 0)

    @property
    def mean_output(self) -> float:
        return self.output_tokens / self.records if self.records else 0.0

    def finish_text(self) -> str:
        """``length 3 (7.5 %), stop 37 (92.5 %)``, or ``none``."""
        return (
            ", ".join(f"{k} {v:,} ({100 * v / self.records:.1f} %)" for k, v in sorted(self.finish.items())) or "none"
        )

    def variant_text(self) -> str | None:
        """``chat 30, thinking 70``, or ``None`` when no record had a variant."""
        if set(self.variants) <= {NO_VARIANT}:
            return None
        return ", ".join(f"{k} {v:,}" for k, v in sorted(self.variants.items()))

    def summary_lines(self) -> list[str]:
        """The lines both the run's summary and ``stats`` print."""
        lines = [
            f"finish reasons: {self.finish_text()}",
            f"output tokens: {self.output_tokens:,} (mean {self.mean_output:,.1f}, max {self.max_output:,}); "
            f"{self.hit_length:,} hit max_new_tokens",
        ]
        variants = self.variant_text()
        if variants is not None:
            lines.append(f"variants: {variants}")
        return lines
