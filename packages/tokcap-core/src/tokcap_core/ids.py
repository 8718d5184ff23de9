"""Ids and keys: rollout ids, call ids, staging and training keys, each its own type.

The types are `typing.NewType`s over ``str``: a type checker refuses a `TrainingKey` where a
`StagingKey` is expected (clearing training rows from the staging partition), at no
run-time cost.
"""

from ._ids import (
    CallId,
    GroupId,
    RolloutId,
    StagingKey,
    TrainingKey,
    call_id_for,
    parse_staging_key,
    staging_key,
    validate_call_id,
    validate_rollout_id,
)
from ._rows import (
    training_key,
)

__all__ = [
    "CallId",
    "GroupId",
    "RolloutId",
    "StagingKey",
    "TrainingKey",
    "call_id_for",
    "parse_staging_key",
    "staging_key",
    "training_key",
    "validate_call_id",
    "validate_rollout_id",
]
