"""What a `GateFleet` keeps per gate, and the report it gives of each."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ._client import ControlPlaneClient

__all__ = ["FleetGateReport", "fleet_metrics"]


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

    def report(self) -> FleetGateReport:
        """What this gate holds and lost, as a `FleetGateReport`."""
        return FleetGateReport(
            url=self.url,
            alive=self.alive,
            open=len(self.open),
            opened=self.opened,
            closed=self.closed,
            released=self.released,
            unreachable=self.unreachable,
        )


def fleet_metrics(reports: Sequence[FleetGateReport]) -> dict[str, float]:
    """``reports`` (a fleet's, in order) as ``fleet/gate<i>/<field>`` floats, plus
    ``fleet/gates_alive``."""
    out = {"fleet/gates_alive": float(sum(r.alive for r in reports))}
    for i, r in enumerate(reports):
        for name in ("alive", "open", "opened", "closed", "released", "unreachable"):
            out[f"fleet/gate{i}/{name}"] = float(getattr(r, name))
    return out
