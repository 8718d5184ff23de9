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

Named submodules hold the rest: `tokcap_vllm.api` (control-plane wire bodies),
`tokcap_vllm.errors`, `tokcap_vllm.fingerprints` (message and output fingerprints),
`tokcap_vllm.persist` (the ledger file), `tokcap_vllm.weights` (push states and
checks) and `tokcap_vllm.extend` (hooks, metrics, the capture host: for extending the
gate).
"""

from .client._client import ControlPlaneClient
from .client._closes import CloseResult, RolloutClose
from .client._fleet import FleetGateReport, GateFleet
from .client._ready import wait_for_gates
from .errors import (
    ControlAuthError,
    ControlConflict,
    ControlNotFound,
    ControlPlaneError,
    ControlRequestError,
    ControlUnreachable,
    GateError,
)
from .gate._config import CONTROL_TOKEN_ENV, LEDGER_PATH_ENV, GateConfig
from .gate._gate import Gate
from .persist import LedgerFileError
from .server._inproc import InProcessServer
from .server._middleware import GateMiddleware, install_gate
from .transfer._weight_state import WeightPhase, WeightPushError, WeightState, WeightSyncError
from .transfer._weights import WeightSync
from .transfer._worker import WeightSyncWorker

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
