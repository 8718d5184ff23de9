"""Named sentinels for state machines: compared with ``is``, pickled back to the same object."""

from __future__ import annotations

__all__ = ["Sentinel"]


class Sentinel:
    """A named singleton state; subclass per machine and bind instances at module level."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name  # unpickles as the module-level object of that name
