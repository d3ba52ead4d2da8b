"""One self-contained HTML page of a :class:`StatsReport`: tables, and the plots inline as PNG data URIs."""

from __future__ import annotations

import base64
from html import escape
from typing import Any

from eagle_datagen.report.stats import StatsReport

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .4em 0; } td, th { border: 1px solid #ccc; padding: .2em .6em; }
th { background: #f3f3f3; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #8a5a00; } figure { margin: 1em 0; } img { max-width: 100%; }
"""
_TITLES = {
    "lengths": "Output length per variant",
    "finish": "Finish reasons",
    "coverage": "Draft-vocabulary coverage",
    "throughput": "Throughput over time",
}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f'<td class="n">{value:,.4g}</td>'
    if isinstance(value, int):
        return f'<td class="n">{value:,}</td>'
    return f"<td>{escape(str(value))}</td>"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _counts(title: str, counts: dict[str, int], total: int) -> str:
    rows: list[list[Any]] = [[k, v, f"{100 * v / total:.1f} %" if total else "-"] for k, v in counts.items()]
    return f"<h2>{escape(title)}</h2>" + _table(["", "records", "share"], rows)


def render_html(report: StatsReport, pngs: dict[str, bytes]) -> str:
    """The page; every image is a ``data:`` URI, so the file is all one needs to open."""
    data = report.to_json()
    total = data["records"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>eagle-datagen stats: {escape(report.directory)}</title><style>{_CSS}</style></head><body>",
        f"<h1>eagle-datagen stats: {escape(report.directory)}</h1>",
        f"<p>{total:,} records, {data['bytes'] / 1e6:,.1f} MB in {len(report.shards)} shard file(s).</p>",
    ]
    parts += [f"<p class='note'>{escape(n)}</p>" for n in report.notes]
    lengths = [
        ["output", *data["output_tokens"].values()],
        ["prompt", "", "", *data["prompt_tokens"].values()],
        ["reasoning", "", "", *data["reasoning"]["length"].values()],
        ["answer", "", "", *data["answer"]["length"].values()],
    ]
    parts.append("<h2>Lengths (tokens)</h2>")
    parts.append(_table(["", "total", "mean", "p50", "p90", "p99", "max"], lengths))
    summary = [
        ["hit max_new_tokens", data["hit_max_new_tokens"]["count"], data["hit_max_new_tokens"]["share"]],
        ["reasoning share of output tokens", data["reasoning"]["tokens"], data["reasoning"]["share"]],
        ["reasoning never closed", data["reasoning"]["unclosed"], ""],
        ["empty answers", data["answer"]["empty"], ""],
        ["tool-call turns", data["tool_call_turns"], ""],
    ]
    parts.append(_table(["", "records / tokens", "share"], summary))
    parts.append(_counts("Finish reasons", data["finish"], total))
    parts.append(_counts("Variants", data["variants"], total))
    by_variant = [
        [name, v["records"], *v["output_tokens"].values(), v["hit_max_new_tokens"], v["reasoning_share"]]
        for name, v in data["by_variant"].items()
    ]
    header = ["variant", "records", "output tokens", "p50", "p90", "p99", "max", "hit cap", "reasoning share"]
    parts.append(_table(header, by_variant))
    parts.append(_counts("Turns", data["turns"], total))
    parts.append(_counts("Servers", data["servers"], total))
    coverage = data["coverage"]
    if coverage.get("tokens"):
        parts.append("<h2>Draft-vocabulary coverage</h2>")
        rows: list[list[Any]] = [[f"top {k}", v] for k, v in coverage["top"].items()]
        rows += [[f"ids covering {q} %", n] for q, n in coverage["ids_for"].items()]
        parts.append(_table(["", "value"], rows))
    per_server = data["throughput"].get("per_server", {})
    if per_server:
        parts.append("<h2>Throughput per server</h2>")
        rows = [
            [url, s["records"], s["output_tokens"], s["tok_s"], s["latency_s"]["mean"], s["latency_s"]["max"]]
            for url, s in per_server.items()
        ]
        parts.append(_table(["server", "records", "output tokens", "tok/s", "latency mean s", "max s"], rows))
    for name, png in pngs.items():
        title = _TITLES.get(name, name)
        uri = "data:image/png;base64," + base64.b64encode(png).decode()
        parts.append(
            f"<figure id='{name}'><img alt='{escape(title)}' src='{uri}'>"
            f"<figcaption>{escape(title)}</figcaption></figure>"
        )
    parts.append("</body></html>\n")
    return "\n".join(parts)
