"""Every error tokcap-vllm raises: the gate's answers (each with its HTTP status), the
control-plane client's, the ledger file's and the weight push's."""

from ._errors import (
    BadRequest,
    CallNotServed,
    ControlAuthError,
    ControlConflict,
    ControlNotFound,
    ControlPlaneError,
    ControlRequestError,
    ControlUnavailable,
    ControlUnreachable,
    GateError,
    InvalidBody,
    MethodNotAllowed,
    RolloutConflict,
    RolloutNotFound,
    TooLarge,
    TooManyRollouts,
    Unauthorized,
    Unsupported,
    UnsupportedTokenizer,
    WeightsUnavailable,
)
from ._lifecycle import CallStateError
from ._weight_state import WeightPushError, WeightSyncError
from .persist import LedgerFileError

__all__ = [
    "BadRequest",
    "CallNotServed",
    "CallStateError",
    "ControlAuthError",
    "ControlConflict",
    "ControlNotFound",
    "ControlPlaneError",
    "ControlRequestError",
    "ControlUnavailable",
    "ControlUnreachable",
    "GateError",
    "InvalidBody",
    "LedgerFileError",
    "MethodNotAllowed",
    "RolloutConflict",
    "RolloutNotFound",
    "TooLarge",
    "TooManyRollouts",
    "Unauthorized",
    "Unsupported",
    "UnsupportedTokenizer",
    "WeightPushError",
    "WeightSyncError",
    "WeightsUnavailable",
]
