"""Test-only stand-in for `sgl_kernel` (SGLang's CUDA/AMX kernels; the CPU build exists only as source).

SGLang's CPU text path only does module-level `from sgl_kernel import X`. Every such name is a function that
raises NotImplementedError(name), so a kernel that is really called fails loudly instead of being skipped.
Submodules (`sgl_kernel.scalar_type`, ...) are deliberately absent: SGLang catches their ImportError and falls
back to its own mocks, which a stub would break.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def _stand_in(name: str) -> Callable[..., NoReturn]:
    """A function that raises NotImplementedError(name) when called."""

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(name)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str) -> Any:
    """PEP 562 hook: any public name is a stand-in kernel; dunder names stay missing."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _stand_in(name)
