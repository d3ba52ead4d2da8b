"""Run directories for the export tests, written by the real ShardStore and Manifest.

Synthetic ids over a small vocabulary (no tokenizer needed): ``VOCAB`` ids, ``EOS`` the stop id, no think
tokens. Turn records (``--turns all`` data, issue 12) are made by hand the way that issue specifies them:
``id = KEY@t{k}`` (``KEY#i@t{k}`` with samples), ``conversation`` = the key, ``turn`` = k.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.store.shards import ShardStore

VOCAB = 1000
EOS = 999
MAX_NEW = 24

Plant = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class Run:
    out: Path
    records: list[dict[str, Any]]


def _manifest(out: Path, *, shard_size: int, samples: int | None) -> Manifest:
    plan: dict[str, Any] = {
        "prompts": {"path": "/nonexistent/prompts.jsonl", "sha256": "0" * 64},
        "tokenizer": {"path": "/nonexistent/tokenizer", "fingerprint": "x"},
        "chat_template_kwargs": {},
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0},
        "shard_size": shard_size,
    }
    if samples is not None:
        plan["samples_per_prompt"] = samples
    out.mkdir(parents=True)
    manifest = Manifest(out / MANIFEST_NAME, plan)
    manifest.facts = {"vocab_size": VOCAB, "model_vocab_size": VOCAB, "eos_token_ids": [EOS], "stop_token_ids": [EOS]}
    manifest.save()
    return manifest


def single_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` single-turn records; every 4th one finishes with ``length``."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        prompt = [rng.randrange(EOS) for _ in range(rng.randrange(3, 30))]
        if i % 4 == 3:
            output = [rng.randrange(EOS) for _ in range(MAX_NEW)]
            finish: dict[str, Any] = {"type": "length", "length": MAX_NEW}
        else:
            output = [*(rng.randrange(EOS) for _ in range(rng.randrange(1, MAX_NEW - 1))), EOS]
            finish = {"type": "stop", "matched": EOS}
        records.append(
            {
                "id": f"k{i}",
                "key": f"k{i}",
                "sample": 0,
                "prompt_ids": prompt,
                "output_ids": output,
                "finish_reason": finish,
                "completion_tokens": len(output),
            }
        )
    return records


def turn_records(
    conversations: int, turns: int, *, seed: int = 0, rewrite: set[str] | None = None
) -> list[dict[str, Any]]:
    """Multi-turn records: turn k's prompt = turn k-1's prompt + output + a new user message, unless the
    conversation is in ``rewrite`` (then its history is changed, as a template dropping reasoning does)."""
    rng = random.Random(seed)
    records = []
    for c in range(conversations):
        key = f"c{c}"
        history: list[int] = []
        for k in range(1, turns + 1):
            user = [rng.randrange(EOS) for _ in range(rng.randrange(2, 8))]
            prompt = [*history, *user]
            if rewrite and key in rewrite and k > 1:
                prompt = prompt[1:]  # the template rewrote the history
            output = [*(rng.randrange(EOS) for _ in range(rng.randrange(1, 10))), EOS]
            records.append(
                {
                    "id": f"{key}@t{k}",
                    "key": key,
                    "sample": 0,
                    "prompt_ids": prompt,
                    "output_ids": output,
                    "finish_reason": {"type": "stop", "matched": EOS},
                    "completion_tokens": len(output),
                    "conversation": key,
                    "turn": k,
                }
            )
            history = [*prompt, *output]
    return records


def make_run(
    tmp: Path,
    records: list[dict[str, Any]],
    *,
    shard_size: int = 8,
    finish: bool = True,
    samples: int | None = 1,
    name: str = "run",
    raw_lines: dict[int, bytes] | None = None,
) -> Run:
    """Writes ``records`` through ShardStore (finalizing the last shard unless ``finish`` is False).

    ``raw_lines`` replaces the line of record i with the given bytes (a corruption)."""
    out = tmp / name
    manifest = _manifest(out, shard_size=shard_size, samples=samples)
    store = ShardStore(out / "shards", shard_size, manifest.add_shard)
    store.open({})
    for i, record in enumerate(records):
        line = (raw_lines or {}).get(i) or orjson.dumps(record) + b"\n"
        store.append(record["id"], line)
    if finish:
        store.finish()
    store.close()
    return Run(out, records)


def expected_rows(records: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """What every exporter must write for single rows: prompt + output, mask 0 then 1."""
    return [
        (r["prompt_ids"] + r["output_ids"], [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])) for r in records
    ]
