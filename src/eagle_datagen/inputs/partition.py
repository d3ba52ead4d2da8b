"""``--partition I/N``: which prompt keys one of N independent jobs owns.

A key belongs to partition ``blake2b-64(key) mod N`` (the key as UTF-8, the first 8 bytes of its
BLAKE2b digest read big-endian). The hash depends on the key alone, so the split is the same on every
machine, under resume and whatever the row order; every sample of a prompt lands in the prompt's
partition, which keeps its shared prefix on one server's radix cache. N jobs with ``--partition 0/N`` …
``(N-1)/N`` cover the prompts exactly once; ``eagle-datagen merge`` proves it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from eagle_datagen.errors import UsageError

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class Partition:
    """Partition ``index`` of ``count`` (0-based)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Partition:
        """``"I/N"`` with ``0 <= I < N``; anything else is a :class:`UsageError` saying what is expected."""
        match = _SPEC.match(text)
        if match is None:
            raise UsageError(f"--partition {text!r}: expected I/N with integers, e.g. --partition 0/8")
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1:
            raise UsageError(f"--partition {text!r}: N must be at least 1")
        if index >= count:
            raise UsageError(
                f"--partition {text!r}: I is 0-based and must be below N (0/{count} … {count - 1}/{count})"
            )
        return cls(index, count)

    def owns(self, key: str) -> bool:
        return partition_of(key, self.count) == self.index

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "hash": "blake2b-64(key) mod count"}

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def partition_of(key: str, count: int) -> int:
    """The partition of ``key`` among ``count``."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count
