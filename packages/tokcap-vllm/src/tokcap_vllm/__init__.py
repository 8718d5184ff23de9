"""tokcap adapter for vLLM: the capture host and the OpenAI-compatible gate.

The gate runs *inside* the user's own vLLM OpenAI server (``--middleware
tokcap_vllm.GateMiddleware``, the opt-in ``vllm.general_plugins`` entry point, or
``tokcap-vllm serve``). A harness points its OpenAI base URL at
``/tokcap/rollouts/{rollout_id}/v1`` (or sends ``X-Tokcap-Rollout-Id``); every call is
admitted against the rollout's custody ledger, generated on the exact token ids the
model produced before (``token_in``), staged into a `tokcap_core.TokenSink` off the
response path, and committed once the sink acknowledged. vLLM itself is not a
dependency: importing vLLM-facing parts without it raises an `ImportError` that names
the install command.

The trainer talks to the gate's authenticated control plane (``/tokcap/v1/...``)
through `ControlPlaneClient` (or `GateFleet` over many gates: each rollout opened on
one gate, every control call routed to it): close rollouts (keeping the ledger head), declare
terminals, fetch and verify manifests into receipts, release. A trainer started together
with its gates waits for them with `wait_for_gates`. With
``GateConfig.ledger_path`` the ledgers are persisted, so a restarted gate serves closed
manifests byte-identical and poisons rollouts that were open at the crash. Trainers
push new weights into the running engine with `WeightSync`.

The package is in rooms, each behind its door (a reader looking for one job finds one
folder):

- `tokcap_vllm.gate`: one captured call inside vLLM's server, from its request to its
  commit (the driver, the rollout and call tables, planning, the four APIs, the capture
  host, the gate's configuration);
- `tokcap_vllm.server`: the ASGI door into vLLM's server (`GateMiddleware`),
  ``tokcap-vllm serve``, `InProcessServer`, the plugin entry points;
- `tokcap_vllm.control`: the control plane, the guarded routes and the route table;
- `tokcap_vllm.transfer`: weights into an engine (push files, the weight state,
  `WeightSync` and its worker extension, the ``tokcap_shm`` weight-transfer engine);
- `tokcap_vllm.client`: what a trainer runs (`ControlPlaneClient`, `GateFleet`,
  `wait_for_gates`, the weight clients); it imports without vLLM or any engine-side room;
- `tokcap_vllm.persist`: the ledger file.

Modules beside them: `tokcap_vllm.api` (the control plane's wire bodies),
`tokcap_vllm.errors` (every error), `tokcap_vllm.fingerprints` (message and output
fingerprints), and two doors gathering from the rooms: `tokcap_vllm.weights` (pushing
weights: clients, states and checks) and `tokcap_vllm.extend` (hooks, metrics, the capture
host: for extending the gate). The engine-side names here (`Gate`, `GateConfig`,
`GateMiddleware`, `install_gate`, `InProcessServer`) load their room on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client import (
    CloseResult,
    ControlPlaneClient,
    FleetGateReport,
    GateFleet,
    RolloutClose,
    wait_for_gates,
)
from .errors import (
    ControlAuthError,
    ControlConflict,
    ControlNotFound,
    ControlPlaneError,
    ControlRequestError,
    ControlUnreachable,
    GateError,
    LedgerFileError,
    WeightPushError,
    WeightSyncError,
)
from .transfer import WeightPhase, WeightState, WeightSync, WeightSyncWorker

if TYPE_CHECKING:
    from .gate import CONTROL_TOKEN_ENV, LEDGER_PATH_ENV, Gate, GateConfig
    from .server import GateMiddleware, InProcessServer, install_gate

__all__ = [
    "CONTROL_TOKEN_ENV",
    "LEDGER_PATH_ENV",
    "CloseResult",
    "ControlAuthError",
    "ControlConflict",
    "ControlNotFound",
    "ControlPlaneClient",
    "ControlPlaneError",
    "ControlRequestError",
    "ControlUnreachable",
    "FleetGateReport",
    "Gate",
    "GateConfig",
    "GateError",
    "GateFleet",
    "GateMiddleware",
    "InProcessServer",
    "LedgerFileError",
    "RolloutClose",
    "WeightPhase",
    "WeightPushError",
    "WeightState",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncWorker",
    "install_gate",
    "wait_for_gates",
]

_ENGINE_SIDE = {
    "CONTROL_TOKEN_ENV": "gate",
    "LEDGER_PATH_ENV": "gate",
    "Gate": "gate",
    "GateConfig": "gate",
    "GateMiddleware": "server",
    "InProcessServer": "server",
    "install_gate": "server",
}
"""The names of the engine-side rooms, loaded on first use: importing the trainer's room
(`tokcap_vllm.client`) or the wire bodies loads neither the gate nor its server."""


def __getattr__(name: str) -> Any:
    if name not in _ENGINE_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import gate, server

    rooms = {"gate": gate, "server": server}
    value = getattr(rooms[_ENGINE_SIDE[name]], name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
