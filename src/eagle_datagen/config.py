"""Configuration, one dataclass per concern, validated where it is built."""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_datagen.errors import UsageError
from eagle_datagen.inputs.partition import Partition
from eagle_datagen.inputs.render import read_json_file
from eagle_datagen.inputs.sources import Columns

#: ``sampling_params`` keys SGLang 0.5.x accepts on /generate; any other key is an HTTP 400.
SGLANG_SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
SGLANG_SAMPLING_KEYS = frozenset(SGLANG_SAMPLING_FIELDS)
SGLANG_INT_KEYS = frozenset({"max_new_tokens", "top_k", "n", "min_new_tokens", "sampling_seed"})
#: Keys that would make the stored ids something other than the model's free output.
REFUSED_SAMPLING_KEYS = {
    "n": "use --samples-per-prompt (n>1 replaces our request ids)",
    "ignore_eos": "outputs would never end in EOS",
    "stop": "stop strings cut outputs at text, not token, boundaries; use stop_token_ids",
    "stop_regex": "stop patterns cut outputs at text, not token, boundaries; use stop_token_ids",
    "max_new_tokens": "use --max-new-tokens",
}
#: generation_config.json fields that serving applies as sampling defaults.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULT_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class SamplingConfig:
    """The ``sampling_params`` sent with every request; recorded in the manifest."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    params: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0})
    source: str = "greedy"
    #: Where each sent value came from (:func:`resolve_sampling`); recorded in the manifest.
    origins: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise UsageError("--max-new-tokens must be an integer")
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        validate_sampling_params(self.params)

    def to_request(self) -> dict[str, Any]:
        """The exact ``sampling_params`` object for /generate."""
        return {"max_new_tokens": self.max_new_tokens, **self.params}


def validate_sampling_params(params: dict[str, Any]) -> None:
    """Refuses keys SGLang would reject (HTTP 400) or that would corrupt the data."""
    for key, value in params.items():
        if key not in SGLANG_SAMPLING_KEYS:
            raise UsageError(
                f"sampling parameter {key!r} is not accepted by SGLang's /generate (it answers 400); "
                f"valid keys: {', '.join(sorted(SGLANG_SAMPLING_KEYS))}"
            )
        if key in REFUSED_SAMPLING_KEYS:
            raise UsageError(f"sampling parameter {key!r} is refused: {REFUSED_SAMPLING_KEYS[key]}")
        if key in SGLANG_INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"sampling parameter {key!r} must be an integer (SGLang rejects {value!r})")
    temperature = params.get("temperature")
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise UsageError(f"--temperature must be >= 0, got {temperature!r}")
    top_p = params.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise UsageError(f"--top-p must be in (0, 1], got {top_p!r}")
    top_k = params.get("top_k")
    if top_k is not None and (top_k == 0 or top_k < -1):
        raise UsageError(f"--top-k must be -1 (whole vocabulary) or >= 1, got {top_k!r}")
    min_p = params.get("min_p")
    if min_p is not None and (not _is_number(min_p) or not 0 <= min_p <= 1):
        raise UsageError(f"--min-p must be in [0, 1], got {min_p!r}")
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None and (
        not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids)
    ):
        raise UsageError("stop_token_ids must be a list of integers")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: Where a sampling value came from (``SamplingConfig.origins``); any key not sent takes SGLang's own default
#: (and the server's ``--preferred-sampling-params``, recorded in the manifest's server facts).
ORIGIN_DEFAULT = "eagle-datagen default"
ORIGIN_GENERATION = "generation_config.json"
ORIGIN_PRESET = "preset"
ORIGIN_FLAG = "flag"


def resolve_sampling(
    model_dir: Path | None,
    *,
    max_new_tokens: int | None,
    overrides: dict[str, Any],
    preset: dict[str, Any] | None = None,
    preset_max_new_tokens: int | None = None,
    preset_name: str | None = None,
) -> SamplingConfig:
    """Sampling for the run: generation_config.json defaults (what serving uses), else greedy;
    then the preset, then explicit flags (``overrides``, ``None`` values ignored).

    ``origins`` names, for every key sent, where its value came from: ``flag``, ``preset NAME``,
    ``generation_config.json`` or ``eagle-datagen default`` (greedy, 4096 new tokens)."""
    params: dict[str, Any] = {}
    origins: dict[str, str] = {}
    preset_label = f"{ORIGIN_PRESET} {preset_name}" if preset_name else ORIGIN_PRESET
    generation = read_json_file(model_dir / "generation_config.json") if model_dir else {}
    defaults = {k: generation[k] for k in GENERATION_DEFAULT_KEYS if generation.get(k) is not None}
    if generation.get("do_sample") is False:
        defaults = {}
    layers = (
        (defaults, ORIGIN_GENERATION),
        (preset or {}, preset_label),
        ({k: v for k, v in overrides.items() if v is not None}, ORIGIN_FLAG),
    )
    for values, label in layers:
        params.update(values)
        origins.update(dict.fromkeys(values, label))
    if "temperature" not in params:
        params["temperature"] = 0.0
        origins["temperature"] = ORIGIN_DEFAULT
    if max_new_tokens is not None:
        same = preset_max_new_tokens is not None and max_new_tokens == preset_max_new_tokens
        origins = {"max_new_tokens": preset_label if same else ORIGIN_FLAG, **origins}
    else:
        origins = {"max_new_tokens": ORIGIN_DEFAULT, **origins}
    return SamplingConfig(
        max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        params=params,
        source=describe_origins(origins, greedy=params.get("temperature") == 0),
        origins=origins,
    )


def describe_origins(origins: dict[str, str], *, greedy: bool) -> str:
    """One line for the terminal: ``greedy``, ``preset qwen3``, ``generation_config.json + flags``, ..."""
    kinds: list[str] = []
    for key, origin in origins.items():
        if key == "max_new_tokens":
            continue
        kind = "flags" if origin == ORIGIN_FLAG else origin
        if kind == ORIGIN_DEFAULT:
            kind = "greedy" if greedy else kind
        if kind not in kinds:
            kinds.append(kind)
    return " + ".join(kinds) or "greedy"


def sampling_split(merged: dict[str, Any], preset: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits the merged sampling values into (those the preset gave, those a flag gave).

    Flags override the preset, so a value equal to the preset's is the preset's; this holds on resume
    too, where both arrive merged from the manifest."""
    from_preset = {k: v for k, v in merged.items() if v is not None and k in preset and preset[k] == v}
    from_flags = {k: v for k, v in merged.items() if v is not None and k not in from_preset}
    return from_preset, from_flags


def parse_json_object(text: str, option: str) -> dict[str, Any]:
    """Parses a JSON object given on the command line."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{option} must be a JSON object, e.g. '{{\"thinking\": true}}' ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{option} must be a JSON object, e.g. '{{\"thinking\": true}}'")
    return value


@dataclass(frozen=True)
class LaunchConfig:
    """How to start a managed SGLang server."""

    model: Path
    server_python: str = "python3"
    tp_size: int = 8
    mem_fraction_static: float = 0.85
    host: str = "127.0.0.1"
    port: int | None = None
    server_args: tuple[str, ...] = ()
    trust_remote_code: bool = False
    startup_timeout_s: float = 3600.0
    allow_reasoning_parser: bool = False
    max_restarts: int = 3
    #: SGLang data parallelism: replicas behind the one port, each with ``tp_size`` GPUs.
    dp_size: int = 1


@dataclass(frozen=True)
class RouterConfig:
    """How to start a managed router over running workers (``--launch-router``)."""

    worker_urls: tuple[str, ...]
    python: str = "python3"
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int | None = None
    prometheus_port: int | None = None
    startup_timeout_s: float = 600.0
    router_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerConfig:
    """Either attach to running servers (``urls``) or launch one (``launch``)."""

    urls: tuple[str, ...] = ()
    launch: LaunchConfig | None = None
    api_key: str | None = field(default=None, repr=False)
    allow_reasoning_parser: bool = False
    preflight: bool = True
    #: PEM file of the CAs to trust for https servers, instead of the system store (``--ca-bundle``).
    ca_bundle: Path | None = None
    #: ``--launch-router``: an sglang-router started over ``urls``, used instead of our own pool.
    router: RouterConfig | None = None

    def __post_init__(self) -> None:
        if bool(self.urls) == (self.launch is not None):
            raise UsageError("give either --server-url (attach to running servers) or --model (launch one)")
        if self.router is not None and not self.urls:
            raise UsageError("--launch-router starts a router over running servers: give them with --server-url")


@dataclass(frozen=True)
class RunConfig:
    """Everything one ``run`` or ``resume`` needs."""

    prompts: Path
    out_dir: Path
    tokenizer: Path
    sampling: SamplingConfig
    server: ServerConfig
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    samples_per_prompt: int = 1
    shard_size: int = 10_000
    concurrency: int | None = None
    checkpoint_records: int = 1000
    checkpoint_interval_s: float = 10.0
    skip_bad_lines: bool = False
    max_retries: int = 5
    request_timeout_s: float = 3600.0
    stall_timeout_s: float = 600.0
    retry_failed: bool = True
    grace_period_s: float = 30.0
    progress: bool = True
    render_workers: int = 0
    #: A request in flight at this many consecutive server crashes is sent alone (generate/pool.py).
    suspect_after_crashes: int = 2
    stop_token_ids: tuple[int, ...] = ()
    preset: str | None = None
    #: Table columns that hold the conversation (Parquet/Arrow inputs).
    input_columns: Columns = field(default_factory=Columns)
    #: ``--partition I/N``: the share of the keys this job owns.
    partition: Partition | None = None
    #: ``--mix``/``--mix-entry`` (an :class:`eagle_datagen.inputs.mix.Mix`), and ``--seed``
    mix: Any = None
    seed: int | None = None
    #: What ``strftime_now`` answers in a date-dependent template (pinned in the manifest at ``run``).
    render_date: datetime.date | None = None
    #: ``client``: the tokenizer's template here; ``server``: SGLang's ``/v1/tokenize`` chat path.
    render: str = "client"
    #: Preflight: render this many sampled rows both ways and stop on the first difference (0: off).
    render_parity_rows: int = 32
    #: ``--turns all`` (an :class:`eagle_datagen.generate.turns.TurnConfig`); ``None``: the last turn only.
    turns: Any = None

    def __post_init__(self) -> None:
        for name in ("samples_per_prompt", "shard_size", "checkpoint_records", "suspect_after_crashes"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise UsageError("--concurrency must be at least 1")
        if self.max_retries < 0:
            raise UsageError("--max-retries must be >= 0")
        for name in ("request_timeout_s", "stall_timeout_s", "checkpoint_interval_s"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive")
        if self.render not in ("client", "server"):
            raise UsageError(f"--render must be 'client' or 'server', got {self.render!r}")
        if self.render_parity_rows < 0:
            raise UsageError("--render-parity-rows must be >= 0")
