"""Test-only start-up hook for the SGLang CPU server (on its PYTHONPATH only, never the tool's).

torchvision 0.28 registers fake kernels for `torchvision::nms`/`qnms` at import even when its C++ ops cannot
load (the PyPI build is CUDA-only), which fails. Defining the two schemas first lets `import torchvision`
succeed. The definitions happen lazily, just before torchvision is first imported.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBS: list[Any] = []  # a torch Library drops its definitions when garbage-collected


def _define_torchvision_schemas() -> None:
    """Define torchvision::nms/qnms unless something already did."""
    import torch

    if hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIBS.append(lib)


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Runs the schema definitions once, when `torchvision` is about to be imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_schemas()
        return None


sys.meta_path.insert(0, _TorchvisionHook())
