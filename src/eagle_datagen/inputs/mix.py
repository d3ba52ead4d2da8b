"""Mixes: weighted variants of chat-template kwargs and sampling overrides, chosen per record.

A mix comes from ``--mix FILE.toml`` or repeatable ``--mix-entry NAME:WEIGHT:JSON``::

    per = "sample"                      # or "prompt": every sample of a prompt takes the same variant

    [variant.thinking]
    weight = 0.7
    chat_template_kwargs = { thinking = true }

    [variant.chat]
    weight = 0.3
    chat_template_kwargs = { thinking = false }
    sampling = { temperature = 0.6 }

    --mix-entry 'thinking:0.7:{"chat_template_kwargs": {"thinking": true}}'

Each record's variant follows from ``sha256(seed, key, sample)`` alone (``sample`` is 0 with
``per = "prompt"``), so it does not move under resume, reordering or partitioning. The record keeps its
variant's name, its chat-template kwargs (the run's, with the variant's over them) and the sampling
params sent; the manifest pins the mix, so ``resume`` refuses a changed one, naming the field.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import orjson

from eagle_datagen.config import validate_sampling_params
from eagle_datagen.errors import UsageError
from eagle_datagen.inputs.prompts import PromptRow

MixPer = Literal["sample", "prompt"]
VARIANT_FIELDS = ("weight", "chat_template_kwargs", "sampling")
TOP_FIELDS = ("per", "variant")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ENTRY_EXAMPLE = '--mix-entry \'chat:0.3:{"chat_template_kwargs": {"thinking": false}}\''
#: Keys a variant's sampling may not set: the run owns them (and verify checks them run-wide).
RUN_OWNED_SAMPLING = {"max_new_tokens": "use --max-new-tokens", "sampling_seed": "use --seed"}
SEED_BITS = 31


@dataclass(frozen=True)
class Variant:
    """One weighted variant: template kwargs over the run's, sampling over the run's."""

    name: str
    weight: float
    chat_template_kwargs: Mapping[str, Any]
    sampling: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "weight": self.weight,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "sampling": dict(self.sampling),
        }


@dataclass(frozen=True)
class Mix:
    """The variants, how they are drawn (``per``) and the seed of the draw."""

    variants: tuple[Variant, ...]
    per: MixPer = "sample"
    seed: int = 0

    def __post_init__(self) -> None:
        total = sum(v.weight for v in self.variants)
        object.__setattr__(self, "_bounds", tuple(_cumulative([v.weight / total for v in self.variants])))

    def choose(self, key: str, sample: int) -> Variant:
        """The variant of record ``(key, sample)``: a function of the seed, the key and the sample only."""
        digest = hashlib.sha256(f"{self.seed}\0{key}\0{sample if self.per == 'sample' else 0}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2**64
        bounds: tuple[float, ...] = getattr(self, "_bounds")  # noqa: B009 (set in __post_init__)
        for variant, bound in zip(self.variants, bounds, strict=True):
            if u < bound:
                return variant
        return self.variants[-1]

    def split(self, row: PromptRow, wanted: Sequence[tuple[str, int]]) -> list[tuple[PromptRow, list[tuple[str, int]]]]:
        """The row once per variant its wanted samples take, each copy carrying that variant's kwargs."""
        groups: dict[str, tuple[Variant, list[tuple[str, int]]]] = {}
        for rid, sample in wanted:
            variant = self.choose(row.key, sample)
            groups.setdefault(variant.name, (variant, []))[1].append((rid, sample))
        return [(replace(row, template_kwargs=dict(v.chat_template_kwargs)), ids) for v, ids in groups.values()]

    def to_json(self) -> dict[str, Any]:
        """What the manifest pins (a dict by name, so a change names ``mix.variants.NAME.FIELD``)."""
        return {"per": self.per, "variants": {v.name: v.to_json() for v in self.variants}}


def _cumulative(shares: list[float]) -> list[float]:
    out, total = [], 0.0
    for share in shares:
        total += share
        out.append(total)
    out[-1] = 1.0
    return out


def sampling_seed(seed: int, record_id: str) -> int:
    """SGLang's per-request ``sampling_seed`` for a record: from ``--seed`` and the record id."""
    digest = hashlib.sha256(f"{seed}\0{record_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & ((1 << SEED_BITS) - 1)


@dataclass(frozen=True)
class RecordPlan:
    """What one record is made with: the sampling params sent and the fields the record keeps."""

    sampling_params: dict[str, Any]
    fields: dict[str, Any]


def record_plan(
    mix: Mix | None,
    seed: int | None,
    base_kwargs: Mapping[str, Any],
    base_sampling: Mapping[str, Any],
    key: str,
    sample: int,
    record_id: str,
) -> RecordPlan | None:
    """``None`` without a mix and a seed (the run's sampling, no extra fields); else the record's own."""
    if mix is None and seed is None:
        return None
    params = dict(base_sampling)
    fields: dict[str, Any] = {}
    if mix is not None:
        variant = mix.choose(key, sample)
        params.update(variant.sampling)
        fields["variant"] = variant.name
        fields["chat_template_kwargs"] = {**base_kwargs, **variant.chat_template_kwargs}
    if seed is not None:
        params["sampling_seed"] = sampling_seed(seed, record_id)
    fields["sampling_params"] = params
    return RecordPlan(params, fields)


# --- reading a mix ------------------------------------------------------------------------------------------


def _variant(name: str, data: Any, where: str) -> Variant:
    if not _NAME.match(name):
        raise UsageError(f"{where}: the variant name {name!r} may hold only letters, digits, '_', '.', '-'")
    if not isinstance(data, dict):
        raise UsageError(f"{where}: variant {name!r} must be a table/object with {', '.join(VARIANT_FIELDS)}")
    unknown = sorted(set(data) - set(VARIANT_FIELDS))
    if unknown:
        raise UsageError(
            f"{where}: variant {name!r} has unknown field(s) {', '.join(map(repr, unknown))}; "
            f"a variant has {', '.join(VARIANT_FIELDS)}"
        )
    weight = data.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise UsageError(f"{where}: variant {name!r} needs a weight >= 0 (a number), got {weight!r}")
    kwargs = data.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise UsageError(
            f'{where}: variant {name!r}: chat_template_kwargs must be an object, e.g. {{"thinking": false}}; '
            f"got {orjson.dumps(kwargs).decode()}"
        )
    sampling = data.get("sampling", {})
    if not isinstance(sampling, dict):
        raise UsageError(f'{where}: variant {name!r}: sampling must be an object, e.g. {{"temperature": 0.6}}')
    for key, fix in RUN_OWNED_SAMPLING.items():
        if key in sampling:
            raise UsageError(f"{where}: variant {name!r}: sampling {key!r} is the run's, not a variant's ({fix})")
    try:
        validate_sampling_params(sampling)
    except UsageError as exc:
        raise UsageError(f"{where}: variant {name!r}: {exc}") from None
    return Variant(name, float(weight), dict(kwargs), dict(sampling))


def parse_entry(text: str) -> tuple[str, Any]:
    """``NAME:WEIGHT:JSON`` → ``(name, {"weight": ..., **json})``."""
    where = f"--mix-entry {text!r}"
    name, sep1, rest = text.partition(":")
    weight_text, sep2, body = rest.partition(":")
    if not (sep1 and sep2 and name):
        raise UsageError(f"{where}: give NAME:WEIGHT:JSON, e.g. {_ENTRY_EXAMPLE}")
    try:
        weight = float(weight_text)
    except ValueError:
        raise UsageError(f"{where}: the weight {weight_text!r} is not a number (NAME:WEIGHT:JSON)") from None
    try:
        data = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"{where}: the JSON is not valid ({exc}); e.g. {_ENTRY_EXAMPLE}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where}: the JSON must be an object with chat_template_kwargs and/or sampling")
    if "weight" in data:
        raise UsageError(f"{where}: give the weight once, between the colons, not in the JSON")
    return name, {"weight": weight, **data}


def load_mix(
    path: Path | str | None,
    entries: Sequence[str] = (),
    *,
    per: str | None = None,
    seed: int | None = None,
) -> Mix | None:
    """The run's mix (``None`` without ``--mix``/``--mix-entry``); refuses bad input naming the entry."""
    if path is not None and entries:
        raise UsageError("give either --mix FILE.toml or --mix-entry, not both")
    raw: list[tuple[str, Any, str]] = []
    file_per: Any = None
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"cannot read --mix {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"--mix {path} is not valid TOML: {exc}") from exc
        unknown = sorted(set(data) - set(TOP_FIELDS))
        if unknown:
            raise UsageError(
                f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; a mix file has 'per' and [variant.NAME] tables"
            )
        variants = data.get("variant")
        if not isinstance(variants, dict) or not variants:
            raise UsageError(f"{path}: no [variant.NAME] tables; e.g. [variant.chat] weight = 0.3")
        raw = [(name, body, f"{path} [variant.{name}]") for name, body in variants.items()]
        file_per = data.get("per")
    for text in entries:
        name, body = parse_entry(text)
        if any(name == n for n, _, _ in raw):
            raise UsageError(f"--mix-entry {text!r}: the variant name {name!r} is given twice")
        raw.append((name, body, f"--mix-entry {text!r}"))
    if not raw:
        if per is not None:
            raise UsageError("--mix-per needs a mix: give --mix FILE.toml or --mix-entry")
        return None
    chosen_per = per if per is not None else file_per if file_per is not None else "sample"
    if chosen_per not in ("sample", "prompt"):
        raise UsageError(f"the mix's per is {chosen_per!r}; give 'sample' or 'prompt'")
    variants_ = tuple(_variant(name, body, where) for name, body, where in raw)
    total = sum(v.weight for v in variants_)
    if not total > 0:
        names = ", ".join(f"{v.name}={v.weight:g}" for v in variants_)
        raise UsageError(f"the mix's weights ({names}) must sum to a positive number")
    return Mix(variants_, per="prompt" if chosen_per == "prompt" else "sample", seed=seed or 0)


def describe_mix(mix: Mix) -> str:
    """``thinking 70 % {"thinking":true}; chat 30 % {"thinking":false} sampling {...}`` for the start banner."""
    total = sum(v.weight for v in mix.variants)
    parts = []
    for v in mix.variants:
        text = f"{v.name} {100 * v.weight / total:.0f} %"
        if v.chat_template_kwargs:
            text += f" kwargs {orjson.dumps(dict(v.chat_template_kwargs)).decode()}"
        if v.sampling:
            text += f" sampling {orjson.dumps(dict(v.sampling)).decode()}"
        parts.append(text)
    return "; ".join(parts)
