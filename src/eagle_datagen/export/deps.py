"""Optional dependencies of ``export`` / ``vocab-map``, imported only when a format needs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from eagle_datagen.errors import UsageError

EXTRA = "export"
#: import name → the package name pip knows it by
_PACKAGES = {"numpy": "numpy", "torch": "torch", "pyarrow": "pyarrow", "datasets": "datasets"}


def need(module: str, purpose: str) -> ModuleType:
    """Imports ``module`` or raises a :class:`UsageError` that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = _PACKAGES.get(module.split(".")[0], module)
        raise UsageError(
            f"{purpose} needs the Python package {package!r}, which is not installed here ({exc}). "
            f"Install the optional dependencies with: pip install 'eagle-datagen[{EXTRA}]'"
        ) from None
