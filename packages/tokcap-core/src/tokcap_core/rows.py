"""Training rows: reassembly of verified staged calls, placeholders, groups of rollouts."""

from ._group import (
    GroupResult,
    on_chain_keys,
    reassemble_group,
)
from ._reassembly import (
    reassemble,
)
from ._rows import (
    CallSpan,
    TrainingRow,
    placeholder_row,
)
from .ids import (
    training_key,
)

__all__ = [
    "CallSpan",
    "GroupResult",
    "TrainingRow",
    "on_chain_keys",
    "placeholder_row",
    "reassemble",
    "reassemble_group",
    "training_key",
]
