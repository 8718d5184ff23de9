"""The reassembly RPC contract (metadata only) and the controller's group policy."""

from ._policy import (
    TOO_FEW_VALID,
    UNKNOWN_OUTCOME,
    Accept,
    Drop,
    GroupDecision,
    Replace,
    decide_group,
)
from ._rpc import (
    FORBIDDEN_KEYS,
    MAX_METADATA_DEPTH,
    FinalizedGroup,
    InvalidRequest,
    ReassemblyRequest,
    assert_metadata_only,
)

__all__ = [
    "FORBIDDEN_KEYS",
    "MAX_METADATA_DEPTH",
    "TOO_FEW_VALID",
    "UNKNOWN_OUTCOME",
    "Accept",
    "Drop",
    "FinalizedGroup",
    "GroupDecision",
    "InvalidRequest",
    "ReassemblyRequest",
    "Replace",
    "assert_metadata_only",
    "decide_group",
]
