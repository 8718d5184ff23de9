"""What a `GateFleet` keeps per gate, and the report it gives of each."""

from __future__ import annotations

import attrs

from ._client import ControlPlaneClient

__all__ = ["FleetGateReport"]


@attrs.frozen(kw_only=True)
class FleetGateReport:
    """One gate of a fleet: where it is, whether it answers, what it holds and lost."""

    url: str
    alive: bool
    open: int
    """Rollouts opened there and not yet closed (or lost)."""
    opened: int
    closed: int
    released: int
    unreachable: int
    """Rollouts poisoned ``gate_unreachable`` because this gate stopped answering."""


@attrs.define
class _Gate:
    url: str
    client: ControlPlaneClient
    alive: bool = True
    open: set[str] = attrs.field(factory=set)
    opened: int = 0
    closed: int = 0
    released: int = 0
    unreachable: int = 0
