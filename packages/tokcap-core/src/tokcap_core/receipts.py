"""Receipts: the verified chain of staged calls a rollout trains on, staged-row checks, and
what a receipt leaves uncovered."""

from . import _coverage, _receipt, _verify
from ._coverage import *  # noqa: F403
from ._receipt import *  # noqa: F403
from ._verify import *  # noqa: F403

__all__ = [*_coverage.__all__, *_receipt.__all__, *_verify.__all__]
