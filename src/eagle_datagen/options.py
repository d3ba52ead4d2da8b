"""Run options: defaults < preset (``--config``) < the manifest (on resume) < explicit flags.

Options are a flat dict keyed by CLI parameter name, so a preset, the manifest and the command
line all speak the same language. :func:`build_run_config` turns the merged dict into a
:class:`RunConfig`.
"""

from __future__ import annotations

import os
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from eagle_datagen.config import (
    LaunchConfig,
    RouterConfig,
    RunConfig,
    ServerConfig,
    parse_json_object,
    resolve_sampling,
    sampling_split,
)
from eagle_datagen.errors import UsageError
from eagle_datagen.inputs.mix import load_mix
from eagle_datagen.inputs.partition import Partition
from eagle_datagen.inputs.render import parse_render_date
from eagle_datagen.inputs.sources import Columns
from eagle_datagen.record.family import PRESET_TOKEN_KEYS as FAMILY_TOKEN_KEYS
from eagle_datagen.record.turns import TurnConfig
from eagle_datagen.redaction import MASK, check_api_key, redact_options, redacted_args

API_KEY_ENV = "EAGLE_DATAGEN_API_KEY"

DEFAULTS: dict[str, Any] = {
    "server_url": (),
    "server_python": "python3",
    "tp_size": 8,
    "mem_fraction_static": 0.85,
    "host": "127.0.0.1",
    "port": None,
    "server_arg": (),
    "ca_bundle": None,
    "startup_timeout_s": 3600.0,
    "allow_reasoning_parser": False,
    "max_restarts": 3,
    "dp_size": 1,
    "launch_router": False,
    "router_policy": "cache_aware",
    "router_python": None,
    "router_arg": (),
    "suspect_after_crashes": 2,
    "trust_remote_code": False,
    "chat_template_kwargs": None,
    "max_new_tokens": None,
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "min_p": None,
    "sampling_params": None,
    "samples_per_prompt": 1,
    "shard_size": 10_000,
    "concurrency": None,
    "checkpoint_records": 1000,
    "checkpoint_interval_s": 10.0,
    "skip_bad_lines": False,
    "max_retries": 5,
    "request_timeout_s": 3600.0,
    "stall_timeout_s": 600.0,
    "retry_failed": True,
    "grace_period_s": 30.0,
    "progress": True,
    "preflight": True,
    "render_workers": 0,
    "mix": None,
    "mix_entry": (),
    "mix_per": None,
    "seed": None,
    "render_date": None,
    "turns": "last",
    "on_truncated_turn": "stop",
    "reasoning_parser_name": None,
    "tool_call_parser_name": None,
    "render": "client",
    "render_parity": True,
    "render_parity_rows": 32,
}
#: Options that are never written to the manifest (nor is any secret-named one: :mod:`eagle_datagen.redaction`).
SECRET = frozenset({"api_key"})
#: Options that hold for one invocation only (resume does not inherit them).
TRANSIENT = frozenset({"config", "out", "retry_failed", "progress", "preflight", "render_parity", "render_parity_rows"})
PRESET_SECTIONS = {
    "server": {"tp_size", "mem_fraction_static", "trust_remote_code", "server_arg", "startup_timeout_s"},
    "sampling": {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "sampling_params"},
    "run": {"samples_per_prompt", "shard_size", "concurrency", "max_retries", "request_timeout_s"},
    # SGLang's parser names for --turns all (each reply split as serving splits it): option <key>_name
    "parsers": {"reasoning_parser", "tool_call_parser"},
}
#: Tables whose keys are free (the template's own kwargs) or informational (token facts for readers).
PRESET_FREE_TABLES = ("chat_template_kwargs",)
#: [tokens] keys: the model-family facts, checked against the tokenizer at start (eagle_datagen.record.family).
PRESET_TOKEN_KEYS = frozenset(FAMILY_TOKEN_KEYS)
PRESET_TOP_KEYS = frozenset({"name"})


def load_preset(path: Path) -> dict[str, Any]:
    """Options from a model preset TOML (``configs/*.toml``); any section or key it does not know is refused.

    The preset's sampling values are also kept apart (``preset_sampling``), so the manifest can say which
    value came from the preset and which from a flag (:func:`eagle_datagen.config.resolve_sampling`).
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read the preset {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from exc
    check_preset_layout(path, data)
    options: dict[str, Any] = {}
    for section in PRESET_SECTIONS:
        for key, value in data.get(section, {}).items():
            if section == "parsers":
                key = f"{key}_name"
            options[key] = tuple(value) if key == "server_arg" else value
    kwargs = data.get("chat_template_kwargs")
    if kwargs:
        options["chat_template_kwargs"] = dict(kwargs)
    options["preset_tokens"] = dict(data.get("tokens", {}))
    options["preset_name"] = data.get("name", path.stem)
    options["preset_sampling"] = dict(data.get("sampling", {}))
    return options


def check_preset_layout(path: Path, data: dict[str, Any]) -> None:
    """Refuses unknown top-level keys, unknown sections and unknown keys, naming them and what is known."""
    tables = (*PRESET_SECTIONS, *PRESET_FREE_TABLES, "tokens")
    for name, value in data.items():
        if isinstance(value, dict):
            if name not in tables:
                raise UsageError(
                    f"{path}: [{name}] is not a preset section; known sections: {', '.join(f'[{t}]' for t in tables)}"
                )
        elif name not in PRESET_TOP_KEYS:
            hint = f" (a [{name}] section?)" if name in tables else ""
            raise UsageError(
                f"{path}: top-level key {name!r} is not a preset option{hint}; known top-level keys: "
                f"{', '.join(sorted(PRESET_TOP_KEYS))}; sections: {', '.join(f'[{t}]' for t in tables)}"
            )
    if "name" in data and not isinstance(data["name"], str):
        raise UsageError(f'{path}: name must be a string, e.g. name = "{path.stem}"')
    known_keys = {**PRESET_SECTIONS, "tokens": PRESET_TOKEN_KEYS}
    for section, allowed in known_keys.items():
        for key in data.get(section, {}):
            if key not in allowed:
                raise UsageError(
                    f"{path}: [{section}] {key} is not a preset option; allowed: {', '.join(sorted(allowed))}"
                )


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; ``None`` in a later layer does not erase an earlier value."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    return merged


def savable(options: dict[str, Any]) -> dict[str, Any]:
    """The options worth recording for ``resume`` (no secrets, paths made absolute)."""
    saved = {}
    for key, value in redact_options(options).items():
        if key in SECRET or key in TRANSIENT:
            continue
        if isinstance(value, Path):
            value = str(value.resolve())
        elif isinstance(value, tuple):
            value = list(value)
        saved[key] = value
    return saved


def build_run_config(options: dict[str, Any]) -> RunConfig:
    """Validates the merged options and builds the run's configuration."""
    opts = {**DEFAULTS, **merge(options)}
    prompts = _path(opts, "prompts")
    out = _path(opts, "out")
    model = Path(opts["model"]) if opts.get("model") else None
    tokenizer = Path(opts["tokenizer"]) if opts.get("tokenizer") else model
    if tokenizer is None:
        raise UsageError("give --tokenizer (or --model, whose tokenizer is then used) to render prompts")
    kwargs = opts.get("chat_template_kwargs") or {}
    if isinstance(kwargs, str):
        kwargs = parse_json_object(kwargs, "--chat-template-kwargs")
    extra = opts.get("sampling_params") or {}
    if isinstance(extra, str):
        extra = parse_json_object(extra, "--sampling-params")
    overrides = {k: opts.get(k) for k in ("temperature", "top_p", "top_k", "min_p")}
    preset_sampling = opts.get("preset_sampling") or {}
    preset_extra = preset_sampling.get("sampling_params") or {}
    preset_values = {
        **(preset_extra if isinstance(preset_extra, dict) else {}),
        **{k: preset_sampling[k] for k in overrides if k in preset_sampling},
    }
    from_preset, from_flags = sampling_split({**extra, **overrides}, preset_values)
    sampling = resolve_sampling(
        model or tokenizer,
        max_new_tokens=opts.get("max_new_tokens"),
        overrides=from_flags,
        preset=from_preset,
        preset_max_new_tokens=preset_sampling.get("max_new_tokens"),
        preset_name=opts.get("preset_name"),
    )
    api_key = _api_key(opts)
    urls = tuple(u.rstrip("/") for u in opts.get("server_url") or ())
    _check_no_credentials_in_urls(urls)
    launch = None
    _check_no_masked_server_args(tuple(opts["server_arg"]), opts.get("out"))
    if not urls:
        if model is None:
            raise UsageError("give --model to launch an SGLang server, or --server-url to use running ones")
        launch = LaunchConfig(
            model=model,
            server_python=opts["server_python"],
            tp_size=opts["tp_size"],
            mem_fraction_static=opts["mem_fraction_static"],
            host=opts["host"],
            port=opts["port"],
            server_args=tuple(opts["server_arg"]),
            trust_remote_code=opts["trust_remote_code"],
            startup_timeout_s=opts["startup_timeout_s"],
            allow_reasoning_parser=opts["allow_reasoning_parser"],
            max_restarts=opts["max_restarts"],
            dp_size=opts["dp_size"],
        )
    server = ServerConfig(
        urls=urls,
        launch=launch,
        api_key=api_key,
        allow_reasoning_parser=opts["allow_reasoning_parser"],
        preflight=opts["preflight"],
        ca_bundle=Path(opts["ca_bundle"]) if opts.get("ca_bundle") else None,
        router=RouterConfig(
            worker_urls=urls,
            python=opts["router_python"] or opts["server_python"],
            policy=opts["router_policy"],
            router_args=tuple(opts["router_arg"]),
        )
        if opts["launch_router"]
        else None,
    )
    partition = opts.get("partition")
    return RunConfig(
        input_columns=Columns(prompt=opts.get("prompt_column"), messages=opts.get("messages_column")),
        partition=Partition.parse(str(partition)) if partition not in (None, "") else None,
        prompts=prompts,
        out_dir=out,
        tokenizer=tokenizer,
        sampling=sampling,
        server=server,
        chat_template_kwargs=kwargs,
        trust_remote_code=opts["trust_remote_code"],
        samples_per_prompt=opts["samples_per_prompt"],
        shard_size=opts["shard_size"],
        concurrency=opts["concurrency"],
        checkpoint_records=opts["checkpoint_records"],
        checkpoint_interval_s=opts["checkpoint_interval_s"],
        skip_bad_lines=opts["skip_bad_lines"],
        max_retries=opts["max_retries"],
        request_timeout_s=opts["request_timeout_s"],
        stall_timeout_s=opts["stall_timeout_s"],
        retry_failed=opts["retry_failed"],
        grace_period_s=opts["grace_period_s"],
        progress=opts["progress"],
        render_workers=opts["render_workers"],
        suspect_after_crashes=opts["suspect_after_crashes"],
        preset=opts.get("preset_name"),
        mix=load_mix(opts.get("mix"), opts.get("mix_entry") or (), per=opts.get("mix_per"), seed=opts.get("seed")),
        seed=opts.get("seed"),
        render_date=parse_render_date(opts.get("render_date")),
        render=opts["render"],
        turns=_turns(opts),
        render_parity_rows=opts["render_parity_rows"] if opts["render_parity"] else 0,
    )


def _turns(opts: dict[str, Any]) -> TurnConfig | None:
    """``--turns all``'s settings (``None`` for ``last``); parser name ``none`` turns that parser off."""
    mode = opts.get("turns") or "last"
    if mode not in ("last", "all"):
        raise UsageError(f"--turns must be 'last' or 'all', got {mode!r}")
    if mode == "last":
        return None
    on_truncated = opts.get("on_truncated_turn") or "stop"
    if on_truncated not in ("stop", "continue"):
        raise UsageError(f"--on-truncated-turn must be 'stop' or 'continue', got {on_truncated!r}")

    def name(key: str) -> str | None:
        value = opts.get(key)
        if value is not None and not isinstance(value, str):
            raise UsageError(f"--{key.replace('_', '-')} must be a parser name, got {value!r}")
        return None if value in (None, "", "none") else value

    return TurnConfig(
        name("reasoning_parser_name"),
        name("tool_call_parser_name"),
        on_truncated,
        reasoning_parser_given=opts.get("reasoning_parser_name") not in (None, ""),
        tool_call_parser_given=opts.get("tool_call_parser_name") not in (None, ""),
    )


def _api_key(opts: dict[str, Any]) -> str | None:
    """``--api-key``, else ``EAGLE_DATAGEN_API_KEY``; refused when a header cannot carry it."""
    if opts.get("api_key"):
        return check_api_key(str(opts["api_key"]), "--api-key")
    if os.environ.get(API_KEY_ENV):
        return check_api_key(os.environ[API_KEY_ENV], f"the {API_KEY_ENV} environment variable")
    return None


def _check_no_credentials_in_urls(urls: tuple[str, ...]) -> None:
    """``https://user:secret@host``: never used (the key travels as a Bearer header), and it would be saved and shown."""
    for url in urls:
        parts = urlsplit(url)
        if "@" in parts.netloc:
            shown = parts._replace(netloc=f"{MASK}@{parts.netloc.rsplit('@', 1)[1]}").geturl()
            raise UsageError(
                f"--server-url {shown}: a user name or password in the URL is not used (the servers' key is sent "
                "only as 'Authorization: Bearer'), and the URL would be saved in manifest.json and shown; give "
                "the URL without it, and the key with --api-key or EAGLE_DATAGEN_API_KEY"
            )


def _check_no_masked_server_args(args: tuple[str, ...], out: Any) -> None:
    """A ``--server-arg`` secret saved as ``***`` (manifest.json never holds one) must be given again."""
    hidden = redacted_args(args)
    if hidden:
        shown = [a.replace(f"={MASK}", "=VALUE") if "=" in a else ("VALUE" if a == MASK else a) for a in args]
        again = " ".join(shlex.quote(f"--server-arg={a}") for a in shown)
        raise UsageError(
            f"the value of --server-arg {', '.join(hidden)} is a secret, and manifest.json does not keep secrets; "
            f"give the server args again, all of them: eagle-datagen resume --out {shlex.quote(str(out))} {again}"
        )


def _path(opts: dict[str, Any], name: str) -> Path:
    value = opts.get(name)
    if not value:
        raise UsageError(f"--{name} is required")
    return Path(value)
