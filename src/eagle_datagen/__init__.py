"""eagle-datagen: token-exact EAGLE-3 drafter training data from SGLang's native /generate.

The package is grouped by stage (see docs/layout.md): ``inputs`` → ``generate`` → ``record`` → ``store``,
with ``server`` beside the run and ``verify`` over finished shards. Scripts written against the 0.1 flat
layout (``eagle_datagen.shards``, ``eagle_datagen.transport``, …) keep working through lazy aliases.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.1.0"

# Flat 0.1 module names → their home since 0.2. Resolved only when imported, so `--help` loads none.
_FLAT_ALIASES = {
    "prompts": "inputs.prompts",
    "render": "inputs.render",
    "pipeline": "generate.pipeline",
    "pool": "generate.pool",
    "client": "generate.client",
    "transport": "generate.transport",
    "checks": "record.checks",
    "shards": "store.shards",
    "manifest": "store.manifest",
    "logs": "store.logs",
    "durable": "store.durable",
    "launcher": "server.launcher",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self._target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias's spec on the real module: give it its own back.
        module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in _FLAT_ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{__name__}.{_FLAT_ALIASES[name]}"))


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.append(_AliasFinder())
