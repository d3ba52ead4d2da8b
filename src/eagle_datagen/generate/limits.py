"""What a prompt must fit before it is sent: the servers' input bound and the model's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Limits:
    """Per-prompt limits learned from the servers and the model."""

    max_input_len: int | None = None
    model_vocab: int | None = None

    def problem(self, prompt_ids: Sequence[int]) -> tuple[str, str] | None:
        """``(kind, message)`` when ``prompt_ids`` cannot be sent: ``too_long`` or ``out_of_vocab``. The producer
        sets such a row aside; ``--turns all`` ends a conversation whose next turn would not fit."""
        limit = self.max_input_len
        if limit is not None and len(prompt_ids) >= limit:
            return "too_long", f"the prompt has {len(prompt_ids)} tokens; the server accepts < {limit}"
        vocab = self.model_vocab
        if vocab is not None and prompt_ids and max(prompt_ids) >= vocab:
            return "out_of_vocab", f"the prompt has id {max(prompt_ids)} >= the model's vocab_size {vocab}"
        return None
