"""``DIR/manifest.json``: the pinned plan of a run and the record of its finalized shards.

``plan`` holds everything that changes the bytes of a record (prompts file, tokenizer and chat
template, template kwargs, sampling, samples per prompt, shard size); ``resume`` refuses a plan that
differs, naming the field. Everything else (server URLs, concurrency, timeouts) may change freely.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_datagen import __version__
from eagle_datagen.errors import ManifestMismatch, UsageError
from eagle_datagen.store.durable import write_atomic
from eagle_datagen.store.shards import ShardInfo

MANIFEST_NAME = "manifest.json"
FORMAT = 1


@dataclass
class Manifest:
    """The in-memory manifest; :meth:`save` writes it atomically."""

    path: Path
    plan: dict[str, Any]
    facts: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardInfo] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @classmethod
    def load(cls, out_dir: Path) -> Manifest:
        path = out_dir / MANIFEST_NAME
        try:
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise UsageError(f"{out_dir} has no {MANIFEST_NAME}: it is not an eagle-datagen output directory") from None
        except orjson.JSONDecodeError as exc:
            raise UsageError(f"{path} is not valid JSON ({exc}); it is written atomically, so it was edited") from None
        if data.get("format") != FORMAT:
            raise UsageError(f"{path} has format {data.get('format')!r}; this eagle-datagen reads format {FORMAT}")
        return cls(
            path=path,
            plan=data["plan"],
            facts=data.get("facts", {}),
            server=data.get("server", {}),
            shards=[ShardInfo(s["name"], s["records"], s["sha256"]) for s in data.get("shards", [])],
            runs=data.get("runs", []),
            created=data.get("created", ""),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "tool_version": __version__,
            "created": self.created,
            "plan": self.plan,
            "facts": self.facts,
            "server": self.server,
            "shards": [s.to_json() for s in self.shards],
            "runs": self.runs,
        }

    def save(self) -> None:
        write_atomic(self.path, orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n")

    def add_shard(self, info: ShardInfo) -> None:
        self.shards = [s for s in self.shards if s.name != info.name] + [info]
        self.shards.sort(key=lambda s: s.name)
        self.save()

    def shard_map(self) -> dict[str, ShardInfo]:
        return {s.name: s for s in self.shards}


def plan_differences(pinned: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the plan fields that differ (a moved prompts file is not a difference)."""
    changed: list[str] = []
    for key in sorted(set(pinned) | set(current)):
        name = f"{prefix}{key}"
        if name in {"prompts.path", "tokenizer.path"}:
            continue
        old, new = pinned.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict) and key != "chat_template_kwargs":
            changed += plan_differences(old, new, f"{name}.")
        elif old != new:
            changed.append(name)
    return changed


def check_plan(pinned: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises :class:`ManifestMismatch` naming each changed field with its old and new value."""
    changed = plan_differences(pinned, current)
    if not changed:
        return
    lines = []
    for name in changed:
        old, new = _lookup(pinned, name), _lookup(current, name)
        lines.append(f"  {name}: pinned {_short(old)}, now {_short(new)}")
    raise ManifestMismatch(
        "resume refuses a changed plan; the records already written were made with the pinned one:\n"
        + "\n".join(lines)
        + "\nRestore what changed (or drop the flags that change it), or start a new run in a new --out directory."
    )


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 80 else text[:77] + "..."
