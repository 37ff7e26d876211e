"""Package exports that load on first use (PEP 562), so that `k3 --help` and `k3 census` import no torch."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: `exports` maps each public name to its defining module."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name]), name)

    return __getattr__
