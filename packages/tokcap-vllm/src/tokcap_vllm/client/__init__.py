"""What a trainer runs against its gates: the control-plane clients and the weight clients.

Imports without vLLM (and without torch: a weight push imports torch when it runs), and
without any engine-side room of this package.

- `ControlPlaneClient` (``_client``): one gate's control plane (httpx, anyio): open,
  close (`RolloutClose`, `CloseResult`, ``_closes``), terminals, manifests checked into
  receipts (also ``_closes``), release;
- `GateFleet` (``_fleet``, ``_fleet_gates``): N gates, each rollout opened on one and every
  control call routed to it (`FleetGateReport`);
- `wait_for_gates` (``_ready``): until every gate of a fleet says it can take calls;
- `GateWeightClient` (``_weight_client``): a full state dict pushed into one served gate
  (`PushTransport`, `StagedPush`); `FleetWeightSync` (``_fleet_weights``): one weight
  version for N gates (`GateOutcome`, `FleetPushError`);
- what the HTTP clients share (``_http``).

Errors are in `tokcap_vllm.errors`; the wire bodies in `tokcap_vllm.api`.
"""

from ._client import ControlPlaneClient
from ._closes import CloseResult, RolloutClose
from ._fleet import FleetGateReport, GateFleet
from ._fleet_weights import FleetPushError, FleetWeightSync, GateOutcome
from ._ready import wait_for_gates
from ._weight_client import GateWeightClient, PushTransport, StagedPush

__all__ = [
    "CloseResult",
    "ControlPlaneClient",
    "FleetGateReport",
    "FleetPushError",
    "FleetWeightSync",
    "GateFleet",
    "GateOutcome",
    "GateWeightClient",
    "PushTransport",
    "RolloutClose",
    "StagedPush",
    "wait_for_gates",
]
