"""The command line: parse options, call the core, map errors to exit codes. No logic lives here."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from eagle_datagen import __version__
from eagle_datagen.errors import DatagenError, InternalError

F = TypeVar("F", bound=Callable[..., Any])

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
PROMPTS_PATH = click.Path(exists=True, path_type=Path)
PROMPTS_HELP = (
    "Prompt rows: JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet, a directory of them, or a save_to_disk dataset."
)
POSITIVE = click.IntRange(min=1)


def generation_options(func: F) -> F:
    """Options shared by ``run`` and ``resume``."""
    options = [
        click.option(
            "--server-url",
            multiple=True,
            help="A running SGLang server (repeatable); work goes to the least busy.",
        ),
        click.option("--api-key", help="The servers' API key (or set EAGLE_DATAGEN_API_KEY); never logged or saved."),
        click.option(
            "--ca-bundle",
            type=EXISTING_FILE,
            help="PEM file of the CAs that sign the https servers' certificates, trusted instead of the system "
            "store [system store, with SSL_CERT_FILE/SSL_CERT_DIR].",
        ),
        click.option("--server-python", help="Python of the environment where SGLang is installed [python3]."),
        click.option("--tp-size", type=POSITIVE, help="Tensor parallel size of a launched server [8]."),
        click.option(
            "--dp-size",
            type=POSITIVE,
            help="Data-parallel replicas of a launched server (SGLang --dp-size), each with --tp-size GPUs [1].",
        ),
        click.option(
            "--launch-router",
            is_flag=True,
            default=None,
            help="Start sglang-router over the --server-url servers and send everything through it.",
        ),
        click.option(
            "--router-policy",
            type=click.Choice(["cache_aware", "round_robin", "power_of_two", "random"]),
            help="Routing policy of --launch-router [cache_aware].",
        ),
        click.option(
            "--router-python", help="Python with sglang-router installed, for --launch-router [--server-python]."
        ),
        click.option("--router-arg", multiple=True, help="Extra argument for --launch-router (repeatable)."),
        click.option("--mem-fraction-static", type=click.FloatRange(0, 1, min_open=True), help="[0.85]"),
        click.option("--host", help="Interface a launched server binds [127.0.0.1]."),
        click.option("--port", type=click.IntRange(1, 65535), help="Port of a launched server [a free one]."),
        click.option(
            "--server-arg",
            multiple=True,
            help="Extra argument for a launched server (repeatable), e.g. --server-arg=--context-length=32768.",
        ),
        click.option(
            "--startup-timeout-s",
            type=click.FloatRange(min=1),
            help="How long a launched server may take to load [3600].",
        ),
        click.option(
            "--allow-reasoning-parser",
            is_flag=True,
            default=None,
            help="Accept a server that runs a reasoning parser.",
        ),
        click.option(
            "--max-restarts",
            type=click.IntRange(min=0),
            help="Restarts of a launched server that crashes within 600 s of a start [3].",
        ),
        click.option(
            "--suspect-after-crashes",
            type=click.IntRange(min=1),
            help="A request in flight at this many server crashes in a row is sent alone; if the server dies "
            "again it is set aside (failures.jsonl, kind server_crash) [2].",
        ),
        click.option(
            "--concurrency",
            type=POSITIVE,
            help="Requests in flight [from the servers' max_running_requests].",
        ),
        click.option(
            "--max-retries",
            type=click.IntRange(min=0),
            help="Retries of a transient failure per request [5].",
        ),
        click.option("--request-timeout-s", type=click.FloatRange(min=1), help="Per-request timeout [3600]."),
        click.option(
            "--stall-timeout-s",
            type=click.FloatRange(min=1),
            help="No progress this long → health check [600].",
        ),
        click.option("--checkpoint-records", type=POSITIVE, help="fsync after this many records [1000]."),
        click.option("--checkpoint-interval-s", type=click.FloatRange(min=0.01), help="...or this many seconds [10]."),
        click.option(
            "--grace-period-s",
            type=click.FloatRange(min=0),
            help="On Ctrl-C, wait this long for requests in flight [30].",
        ),
        click.option(
            "--skip-bad-lines",
            is_flag=True,
            default=None,
            help="Set bad prompt rows aside in rejects.jsonl instead of stopping.",
        ),
        click.option("--progress/--no-progress", default=None, help="Show a progress bar [on]."),
        click.option("--preflight/--no-preflight", default=None, help="Send one short checked request first [on]."),
        click.option(
            "--trust-remote-code",
            is_flag=True,
            default=None,
            help="Run code shipped with the tokenizer/model (Kimi needs it).",
        ),
        click.option(
            "--render-workers",
            type=click.IntRange(min=0),
            help="Processes that render prompts (for slow tokenizers such as Kimi's tiktoken one) [0: in-process].",
        ),
        click.option(
            "--render-parity/--no-render-parity",
            default=None,
            help="Before sending, render sampled rows here and through the server's /v1/tokenize; stop on a difference [on].",
        ),
        click.option(
            "--render-parity-rows",
            type=click.IntRange(min=1),
            help="Rows the render-parity check samples, covering every row shape present [32].",
        ),
        click.option("-v", "--verbose", is_flag=True, help="Log retries and server events."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def plan_options(func: F) -> F:
    """Options that change the bytes (only ``run`` takes them; ``resume`` reads them from the manifest)."""
    options = [
        click.option("--prompts", type=PROMPTS_PATH, required=True, help=PROMPTS_HELP),
        click.option("--prompt-column", help="Parquet/Arrow column holding one user turn (a string)."),
        click.option(
            "--messages-column", help="Parquet/Arrow column holding the messages (a list of {role, content})."
        ),
        click.option(
            "--partition",
            help="Own only the keys of partition I of N (0-based), e.g. 3/8 for job 3 of an 8-job array.",
        ),
        click.option("--out", type=click.Path(path_type=Path), required=True, help="Output directory (new or empty)."),
        click.option(
            "--model",
            type=click.Path(path_type=Path),
            help="Model to launch SGLang with; also the default tokenizer.",
        ),
        click.option("--tokenizer", type=click.Path(path_type=Path), help="Tokenizer directory [the model]."),
        click.option(
            "--config",
            "config",
            type=EXISTING_FILE,
            help="A model preset (configs/*.toml); flags override it.",
        ),
        click.option("--chat-template-kwargs", help="JSON kwargs for the chat template, e.g. '{\"thinking\": true}'."),
        click.option(
            "--max-new-tokens",
            type=POSITIVE,
            help="Output cap per request [4096]; always sent (SGLang's default is 128).",
        ),
        click.option("--temperature", type=click.FloatRange(min=0), help="[generation_config.json, else 0 = greedy]"),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True)),
        click.option("--top-k", type=int, help="[generation_config.json; -1 = no limit]"),
        click.option("--min-p", type=click.FloatRange(0, 1)),
        click.option(
            "--sampling-params",
            help="More SGLang sampling_params as JSON, e.g. '{\"repetition_penalty\": 1.05}'.",
        ),
        click.option(
            "--render",
            type=click.Choice(["client", "server"]),
            help="Render prompts with the tokenizer's template here, or through the server's /v1/tokenize [client].",
        ),
        click.option(
            "--render-date",
            help="Date a date-dependent template (gpt-oss) renders, YYYY-MM-DD; pinned for resume/verify [today].",
        ),
        click.option("--samples-per-prompt", type=POSITIVE, help="Records per prompt (ids KEY#0, KEY#1, ...) [1]."),
        click.option("--shard-size", type=POSITIVE, help="Records per shard [10000]."),
        click.option(
            "--mix",
            type=EXISTING_FILE,
            help="Weighted variants of chat-template kwargs and sampling (TOML; see README 'Mixes').",
        ),
        click.option(
            "--mix-entry",
            multiple=True,
            help='A variant NAME:WEIGHT:JSON (repeatable), e.g. \'chat:0.3:{"chat_template_kwargs": {"thinking": false}}\'.',
        ),
        click.option(
            "--mix-per",
            type=click.Choice(["sample", "prompt"]),
            help="Draw a variant per sample, or one per prompt for all its samples [sample].",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0),
            help="Seeds the mix draw and SGLang's per-request sampling_seed [none; the mix draws with 0].",
        ),
        click.option(
            "--turns",
            type=click.Choice(["last", "all"]),
            help="Regenerate the last assistant turn, or every one, each from the model's own earlier replies "
            "(records KEY@t1, KEY@t2, ...; README 'Multi-turn') [last].",
        ),
        click.option(
            "--on-truncated-turn",
            type=click.Choice(["stop", "continue"]),
            help="--turns all: a turn cut off by max_new_tokens ends its conversation, or goes on as history [stop].",
        ),
        click.option(
            "--reasoning-parser-name",
            help="--turns all: SGLang reasoning parser that splits each reply (kimi_k2, qwen3, deepseek-r1, ...; "
            "'none' for a model that does not reason) [the preset's [parsers]].",
        ),
        click.option(
            "--tool-call-parser-name",
            help="--turns all: SGLang tool-call parser (kimi_k2, qwen25, deepseekv3, glm45, ...; 'none') "
            "[the preset's [parsers]].",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def explicit(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """Only the options the user gave (so presets and the manifest can fill the rest)."""
    given = {}
    for name, value in values.items():
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            given[name] = list(value) if isinstance(value, tuple) else value
    return given


def handle_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DatagenError as exc:
            if isinstance(exc, InternalError) and exc.__cause__ is not None:
                logging.getLogger("eagle_datagen").info("the unexpected error", exc_info=exc.__cause__)
            click.echo(f"Error: {exc}", err=True)
            if exc.continue_with:
                click.echo(f"Continue with:\n  {exc.continue_with}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # a bug: one line, exit 1 (the traceback with -v / --verbose)
            logging.getLogger("eagle_datagen").info("unexpected error", exc_info=True)
            click.echo(
                f"Error: unexpected {type(exc).__name__}: {exc} (a bug; run with -v for the traceback)", err=True
            )
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="eagle-datagen")
def main() -> None:
    """Token-exact EAGLE-3 drafter training data from a model served by SGLang.

    Prompts are rendered on this machine with the model's own chat template, sent as token ids to
    SGLang's native /generate, and stored as prompt_ids + output_ids exactly as returned.

    \b
    Exit codes of run and resume: 0 all done; 3 finished, but some requests failed (failures.jsonl;
    resume sends them again); 1 runtime failure; 2 misuse (bad flags, a bad prompt row, a changed
    plan on resume); 130 interrupted (resume continues).
    """


@main.command()
@plan_options
@generation_options
@click.pass_context
@handle_errors
def run(ctx: click.Context, /, verbose: bool, **values: Any) -> None:
    """Generate a dataset into a new output directory.

    \b
    Launch SGLang on this node (tp=8, no reasoning parser) and generate:
      eagle-datagen run --prompts prompts.jsonl --model /models/Kimi-K2.5 \\
          --config configs/kimi-k2.5.toml --trust-remote-code --out data/
    Use servers that are already running:
      eagle-datagen run --prompts prompts.jsonl --tokenizer /models/Qwen3-8B \\
          --server-url http://node1:30000 --server-url http://node2:30000 --out data/
    """
    from eagle_datagen.app import run_command
    from eagle_datagen.options import load_preset, merge

    _setup_logging(verbose)
    given = explicit(ctx, values)
    preset = load_preset(values["config"]) if values.get("config") else {}
    options = merge(preset, given, {"prompts": values["prompts"], "out": values["out"]})
    outcome = run_command(options)
    _finish(outcome)


@main.command()
@click.option(
    "--out",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="The output directory of the run to continue.",
)
@click.option("--prompts", type=PROMPTS_PATH, help="The prompts file, if it moved (its sha256 must match).")
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path),
    help="The tokenizer, if it moved (its fingerprint must match).",
)
@click.option(
    "--model",
    type=click.Path(path_type=Path),
    help="Launch this model here (replaces a saved --server-url), or where the saved model moved to.",
)
@click.option(
    "--retry-failed/--no-retry-failed",
    default=None,
    help="Send the records in failures.jsonl again [retry].",
)
@generation_options
@click.pass_context
@handle_errors
def resume(ctx: click.Context, /, out: Path, verbose: bool, **values: Any) -> None:
    """Continue a stopped run: repair a torn tail and send only what is missing.

    Refuses (naming the field) when the prompts file, tokenizer, chat-template kwargs or sampling
    differ from the manifest; server and speed options may change freely.

    \b
      eagle-datagen resume --out data/
      eagle-datagen resume --out data/ --server-url http://node3:30000
    """
    from eagle_datagen.app import resume_command

    _setup_logging(verbose)
    outcome = resume_command(out, explicit(ctx, values))
    _finish(outcome)


@main.command("verify-shard")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--prompts", type=PROMPTS_PATH, help="Re-render each record's prompt from this file [the manifest's].")
@click.option("--tokenizer", type=click.Path(path_type=Path), help="Tokenizer for re-rendering [the manifest's].")
@click.option("--trust-remote-code", is_flag=True, help="Run code shipped with the tokenizer (Kimi needs it).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report for machines.")
@click.option(
    "--max-errors", type=click.IntRange(min=1), default=20, show_default=True, help="Examples kept per error kind."
)
@click.option(
    "--server-url",
    help="Also render every prompt through this SGLang server's /v1/tokenize and report where it differs "
    "(API key from EAGLE_DATAGEN_API_KEY).",
)
@handle_errors
def verify_shard(
    paths: tuple[Path, ...],
    prompts: Path | None,
    tokenizer: Path | None,
    trust_remote_code: bool,
    as_json: bool,
    max_errors: int,
    server_url: str | None,
) -> None:
    """Prove that shards are exact: token-level checks on every record.

    PATHS are shard files or a run directory (then all its shards, with its manifest).
    Exit code 0 only when there are no errors.

    \b
      eagle-datagen verify-shard data/
      eagle-datagen verify-shard data/shards/shard_00003.jsonl --json
    """
    from eagle_datagen.verify.verify import verify_command

    sys.exit(
        verify_command(
            list(paths),
            prompts=prompts,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            as_json=as_json,
            max_errors=max_errors,
            server_url=server_url.rstrip("/") if server_url else None,
        )
    )


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report for machines.")
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path), help="Write one self-contained HTML page.")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path), help="Write PNG plots into this folder.")
@click.option(
    "--tokenizer", type=click.Path(path_type=Path), help="Tokenizer files for tool-call ids [the manifest's]."
)
@handle_errors
def stats(directory: Path, as_json: bool, html: Path | None, plots: Path | None, tokenizer: Path | None) -> None:
    """What a run's data holds: lengths, finish reasons, reasoning, coverage, throughput.

    One streaming pass over DIRECTORY/shards (a live run: finished lines only). --plots and --html need
    matplotlib: pip install 'eagle-datagen[plots]'.

    \b
      eagle-datagen stats data/
      eagle-datagen stats data/ --plots plots/ --html report.html
    """
    from eagle_datagen.report.stats import stats_command

    sys.exit(stats_command(directory, as_json=as_json, html=html, plots=plots, tokenizer=tokenizer))


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("record_id", required=False)
@click.option("--random", "random_n", type=POSITIVE, help="Show N records drawn at random (see --seed).")
@click.option(
    "--where", multiple=True, help="Only records with FIELD=VALUE (finish, variant, server, turn, key, sample)."
)
@click.option("--limit", type=POSITIVE, default=1, show_default=True, help="How many matching records to show.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random.")
@click.option("--tokenizer", type=click.Path(path_type=Path), help="Tokenizer to decode with [the manifest's].")
@click.option("--trust-remote-code", is_flag=True, help="Run code shipped with the tokenizer (Kimi needs it).")
@click.option("--color/--no-color", default=None, help="Colors [on a terminal only].")
@handle_errors
def show(
    directory: Path,
    record_id: str | None,
    random_n: int | None,
    where: tuple[str, ...],
    limit: int,
    seed: int,
    tokenizer: Path | None,
    trust_remote_code: bool,
    color: bool | None,
) -> None:
    """One record as a person reads it: prompt, reasoning, answer, tool call, with ids at the boundaries.

    \b
      eagle-datagen show data/ a1
      eagle-datagen show data/ --random 3
      eagle-datagen show data/ --where finish=length --where variant=chat
    """
    from eagle_datagen.report.show import show_command

    sys.exit(
        show_command(
            directory,
            record=record_id,
            random_n=random_n,
            where=where,
            seed=seed,
            limit=limit,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            color=color,
        )
    )


@main.command("merge")
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--copy", is_flag=True, help="Copy the shards into OUT [symbolic links to the partitions' shards].")
@click.option("--prompts", type=PROMPTS_PATH, help="The prompts file, if it moved [the plans'].")
@click.option("--json", "as_json", is_flag=True, help="Print the merge report as JSON.")
@handle_errors
def merge_command(out: Path, run_dirs: tuple[Path, ...], copy: bool, prompts: Path | None, as_json: bool) -> None:
    """Check the partitions of a job array (--partition I/N) and combine them into OUT.

    Refuses runs with different plans, missing or repeated partitions, overlapping or missing records,
    naming counts and the first examples. OUT is then one ordinary run directory: verify-shard OUT.

    \b
      eagle-datagen merge data/all data/part-*
      eagle-datagen verify-shard data/all
    """
    from eagle_datagen.verify.merge import merge_runs

    report = merge_runs(out, list(run_dirs), copy=copy, prompts=prompts)
    if as_json:
        click.echo(orjson_dumps(report.to_json()))
        return
    how = "copied" if report.copied else "linked"
    click.echo(
        f"merged {report.partitions} partitions into {report.out}: {report.records:,} records in "
        f"{report.shards} shards ({how}); {report.set_aside:,} rows set aside by the runs (rejects.jsonl). "
        f"Check it: eagle-datagen verify-shard {report.out}"
    )


def orjson_dumps(value: Any) -> str:
    import orjson

    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def _finish(outcome: Any) -> None:
    from eagle_datagen.app import resume_hint

    click.echo(outcome.summary, err=True)
    if outcome.interrupted:
        click.echo(f"stopped; what arrived is on disk. Continue with:\n  {resume_hint(outcome.out_dir)}", err=True)
    sys.exit(outcome.exit_code)


# --- export / vocab-map (docs/export.md) -------------------------------------------------------------

RUN_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


def _finish_kinds(value: str) -> frozenset[str]:
    from eagle_datagen.export.rows import FINISH_KINDS

    kinds = frozenset(k.strip() for k in value.split(",") if k.strip())
    unknown = sorted(kinds - set(FINISH_KINDS))
    if unknown or not kinds:
        raise click.BadParameter(f"give a comma-separated subset of {','.join(FINISH_KINDS)}, not {value!r}")
    return kinds


@main.command("export")
@click.argument("directory", type=RUN_DIR)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["specforge", "speculators", "speculators-dataset", "parquet"]),
    required=True,
    help="The trainer's format (docs/export.md).",
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="New (or empty) output directory.")
@click.option("--include-finish", default="stop,length", show_default=True, help="Finish reasons to export.")
@click.option("--max-length", type=POSITIVE, help="Longest row in tokens; see --over-length.")
@click.option(
    "--over-length",
    type=click.Choice(["cut", "drop"]),
    default="cut",
    show_default=True,
    help="A row over --max-length is cut to it (as the trainers do) or dropped; both counted.",
)
@click.option("--shuffle-seed", type=int, help="Write rows in a seeded random order [shard order].")
@click.option("--merge-turns", is_flag=True, help="--turns all data: one row per conversation when history extends.")
@click.option(
    "--skip-invalid", is_flag=True, help="Leave out records verify-shard rejects (counted) instead of refusing."
)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar [on].")
@handle_errors
def export_cmd(
    directory: Path,
    fmt: str,
    out: Path,
    include_finish: str,
    max_length: int | None,
    over_length: str,
    shuffle_seed: int | None,
    merge_turns: bool,
    skip_invalid: bool,
    progress: bool,
) -> None:
    """Write a finished run's records as a trainer's training data (input_ids + loss_mask).

    \b
      eagle-datagen export data/ --format specforge --out sf/         # sf/train.jsonl
      eagle-datagen export data/ --format speculators-dataset --out ds/
    """
    from eagle_datagen.export.command import ExportOptions, export_command
    from eagle_datagen.export.rows import RowOptions

    rows = RowOptions(_finish_kinds(include_finish), max_length, over_length, merge_turns)  # type: ignore[arg-type]
    options = ExportOptions(directory, fmt, out, rows, shuffle_seed, skip_invalid, progress)  # type: ignore[arg-type]
    sys.exit(export_command(options))


@main.command("vocab-map")
@click.argument("directory", type=RUN_DIR)
@click.option("--draft-vocab-size", type=POSITIVE, required=True, help="N: ids in the draft vocabulary.")
@click.option("--format", "fmt", type=click.Choice(["specforge", "speculators"]), required=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory for the map (for speculators: the dataset directory you train from).",
)
@click.option("--target-vocab-size", type=POSITIVE, help="The target model's vocab size [the manifest's].")
@click.option("--include-finish", default="stop,length", show_default=True, help="Finish reasons to count.")
@click.option("--skip-invalid", is_flag=True, help="Leave out records verify-shard rejects instead of refusing.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar [on].")
@handle_errors
def vocab_map_cmd(
    directory: Path,
    draft_vocab_size: int,
    fmt: str,
    out: Path,
    target_vocab_size: int | None,
    include_finish: str,
    skip_invalid: bool,
    progress: bool,
) -> None:
    """Draft-vocabulary map (d2t/t2d) from the output tokens' frequencies, plus a coverage report.

    \b
      eagle-datagen vocab-map data/ --draft-vocab-size 32000 --format specforge --out maps/
      eagle-datagen vocab-map data/ --draft-vocab-size 32000 --format speculators --out ds/
    """
    from eagle_datagen.export.vocab import VocabOptions, vocab_map_command

    options = VocabOptions(
        directory,
        draft_vocab_size,
        fmt,  # type: ignore[arg-type]
        out,
        target_vocab_size,
        _finish_kinds(include_finish),
        skip_invalid,
        progress,
    )
    sys.exit(vocab_map_command(options))


if __name__ == "__main__":  # pragma: no cover
    main()
