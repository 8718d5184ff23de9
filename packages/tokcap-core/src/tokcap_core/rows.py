"""Training rows: reassembly of verified staged calls, placeholders, groups of rollouts."""

from . import _reassembly, _rows
from ._reassembly import *  # noqa: F403
from ._rows import *  # noqa: F403
from .ids import training_key

__all__ = [*_reassembly.__all__, *_rows.__all__, "training_key"]
