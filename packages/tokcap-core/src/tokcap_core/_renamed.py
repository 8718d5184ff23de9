"""Deprecation aliases: a renamed public name keeps resolving, with a `DeprecationWarning`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

__all__ = ["renamed_names"]


def renamed_names(module: str, renamed: Mapping[str, type]) -> Callable[[str], object]:
    """A module ``__getattr__`` that resolves each old name in ``renamed`` to its new class."""

    def __getattr__(name: str) -> object:
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = renamed[name]
        message = f"{module}.{name} is deprecated; use {new.__name__}"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return new

    return __getattr__
