"""Staged calls (the token payload a sink holds), their digests and their JSON form."""

from ._staged import (
    FINISH_REASONS,
    StagedCall,
    compute_call_digest,
    logprob_array,
    token_array,
)
from ._staged_json import (
    MAX_STAGED_BYTES,
    STAGED_FORMAT,
    decode_staged_calls,
    encode_staged_calls,
    staged_from_json,
    staged_to_json,
)

__all__ = [
    "FINISH_REASONS",
    "MAX_STAGED_BYTES",
    "STAGED_FORMAT",
    "StagedCall",
    "compute_call_digest",
    "decode_staged_calls",
    "encode_staged_calls",
    "logprob_array",
    "staged_from_json",
    "staged_to_json",
    "token_array",
]
