"""Pushing trainer weights into the running engine: `WeightSync`, its states and its checks."""

from ._spec import TensorSpec, expected_spec, read_checkpoint_spec
from ._weight_state import WeightPhase, WeightPushError, WeightState, WeightSyncError
from ._weights import PauseMode, WeightSync, check_push
from ._worker import WeightSyncWorker

__all__ = [
    "PauseMode",
    "TensorSpec",
    "WeightPhase",
    "WeightPushError",
    "WeightState",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncWorker",
    "check_push",
    "expected_spec",
    "read_checkpoint_spec",
]
