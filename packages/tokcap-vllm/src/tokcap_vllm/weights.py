"""Pushing trainer weights into running engines: one gate, a fleet, or an in-process engine.

A trainer in another process (the deployment shape) uses `GateWeightClient` (one served
gate) or `FleetWeightSync` (N gates, one version): they drive vLLM's own weight-transfer
routes with the gate's bearer token, over tokcap's CPU transport (backend ``tokcap_shm``,
registered with vLLM by the ``vllm.general_plugins`` entry point; on GPU, vLLM's
``nccl``/``ipc`` engines are used as vLLM ships them). The gate serves with
``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "tokcap_shm"}'``.

`WeightSync` (with the `WeightSyncWorker` extension) pushes from inside the server's own
process only (`InProcessServer`); it stays supported there, and is superseded by
`GateWeightClient` for served gates. `StateDictSource` and the ``tokcap_shm`` engine
classes (which import vLLM) are in `tokcap_vllm.transfer`.
"""

from .api import WeightInfo, WeightSpec
from .client import (
    FleetPushError,
    FleetWeightSync,
    GateOutcome,
    GateWeightClient,
    PushTransport,
    StagedPush,
)
from .control import GUARDED_PATHS
from .errors import WeightPushError, WeightSyncError
from .transfer import (
    PUSH_MODES,
    PauseMode,
    PushMode,
    TensorSpec,
    WeightPhase,
    WeightState,
    WeightSync,
    WeightSyncWorker,
    check_push,
    expected_spec,
    read_checkpoint_spec,
)

__all__ = [
    "GUARDED_PATHS",
    "PUSH_MODES",
    "FleetPushError",
    "FleetWeightSync",
    "GateOutcome",
    "GateWeightClient",
    "PauseMode",
    "PushMode",
    "PushTransport",
    "StagedPush",
    "TensorSpec",
    "WeightInfo",
    "WeightPhase",
    "WeightPushError",
    "WeightSpec",
    "WeightState",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncWorker",
    "check_push",
    "expected_spec",
    "read_checkpoint_spec",
]
