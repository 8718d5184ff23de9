"""Named states for h11-style state machines: compared with ``is``, pickled back to the same object.

The core's own machines (the ledger's call and rollout states, the group slots) and the
adapters' (the gate's call and rollout phases) subclass `Sentinel` once per machine and
bind its instances at module level.
"""

from __future__ import annotations

__all__ = ["Sentinel"]


class Sentinel:
    """A named singleton state; subclass per machine and bind instances at module level."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        """The state's name, as bound at module level."""
        return self._name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name  # unpickles as the module-level object of that name
