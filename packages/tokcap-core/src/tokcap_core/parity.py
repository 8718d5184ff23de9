"""Engine-vs-trainer logprob parity, truncated importance weights and sequence ratio masks."""

from ._parity import (
    LogprobParity,
    ParityInputError,
    logprob_parity,
    sequence_ratio_mask,
    truncated_importance_weights,
)

__all__ = [
    "LogprobParity",
    "ParityInputError",
    "logprob_parity",
    "sequence_ratio_mask",
    "truncated_importance_weights",
]
