"""PNG plots of a :class:`StatsReport`, with matplotlib (the optional extra ``eagle-datagen[plots]``).

matplotlib is imported here only, and this module only when ``--plots`` or ``--html`` is given, so the CLI
stays instant without it. Figures are drawn with ``matplotlib.figure.Figure`` (no pyplot, no GUI backend).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eagle_datagen.errors import UsageError
from eagle_datagen.report.stats import COVERAGE_TOPS, StatsReport

INSTALL_HINT = "pip install 'eagle-datagen[plots]'"
#: ``name → (title, drawing function)``; the file is ``name.png``.
PLOT_NAMES = ("lengths", "finish", "coverage", "throughput")


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"--plots and --html draw with matplotlib, which is not installed: {INSTALL_HINT}") from None
    return Figure(figsize=(7.5, 4.0), dpi=100, layout="constrained")


def _lengths(report: StatsReport, fig: Any) -> None:
    ax = fig.add_subplot()
    data = {k: v for k, v in report.variant_outputs.items() if len(v)}
    top = max((int(v.max()) for v in data.values()), default=1)
    bins = np.linspace(0, max(top, 1), 51)
    for name, values in data.items():
        label = "all records" if name == "-" else f"variant {name}"
        ax.hist(values, bins=bins, histtype="step", linewidth=1.6, label=f"{label} ({len(values):,})")
    ax.set_xlabel("output length (tokens)")
    ax.set_ylabel("records")
    ax.set_title("Output length per variant")
    if data:
        ax.legend()


def _finish(report: StatsReport, fig: Any) -> None:
    ax = fig.add_subplot()
    items = sorted(report.tally.finish.items())
    names = [k for k, _ in items]
    counts = [v for _, v in items]
    bars = ax.bar(names, counts, color="#4C72B0")
    ax.bar_label(bars, labels=[f"{c:,}" for c in counts])
    ax.set_ylabel("records")
    ax.set_title("Finish reasons")


def _coverage(report: StatsReport, fig: Any) -> None:
    ax = fig.add_subplot()
    if report.coverage_curve:
        xs, ys = zip(*report.coverage_curve, strict=True)
        ax.plot(xs, [100 * y for y in ys], color="#C44E52", linewidth=2)
        ax.set_xscale("log")
    lines = []
    for k in COVERAGE_TOPS:
        share = report.coverage.get("top", {}).get(str(k))
        if share is not None:
            ax.plot([k], [100 * share], marker="o", color="#333333", markersize=4)
            lines.append(f"top {k // 1024}k ids: {100 * share:.1f} %")
    lines += [f"{q} % needs {n:,} ids" for q, n in report.coverage.get("ids_for", {}).items()]
    if lines:
        ax.text(0.02, 0.97, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=9,
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#cccccc"})  # fmt: skip
    ax.set_xlabel("draft vocabulary size (most frequent output ids)")
    ax.set_ylabel("% of output tokens covered")
    ax.set_ylim(0, 101)
    ax.set_title("Draft-vocabulary coverage")


def _throughput(report: StatsReport, fig: Any) -> None:
    ax = fig.add_subplot()
    bins = report.throughput.get("bins", [])
    if bins:
        width = report.throughput["bin_s"]
        ax.plot([b["start_s"] + width / 2 for b in bins], [b["tok_s"] for b in bins], color="#55A868")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput over time")


_DRAW: dict[str, Callable[[StatsReport, Any], None]] = {
    "lengths": _lengths,
    "finish": _finish,
    "coverage": _coverage,
    "throughput": _throughput,
}


def render_pngs(report: StatsReport) -> dict[str, bytes]:
    """``name → PNG bytes`` for every plot."""
    pngs = {}
    for name in PLOT_NAMES:
        fig = _figure()
        _DRAW[name](report, fig)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        pngs[name] = buffer.getvalue()
    return pngs


def write_plots(pngs: dict[str, bytes], directory: Path) -> list[Path]:
    """Writes ``name.png`` files into ``directory`` (created); returns their paths."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, data in pngs.items():
            path = directory / f"{name}.png"
            path.write_bytes(data)
            paths.append(path)
    except OSError as exc:
        raise UsageError(f"cannot write plots into {directory}: {exc.strerror or exc}") from exc
    return paths
