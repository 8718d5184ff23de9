"""Receipts: the verified chain of staged calls a rollout trains on, and staged-row checks."""

from . import _receipt, _verify
from ._receipt import *  # noqa: F403
from ._verify import *  # noqa: F403

__all__ = [*_receipt.__all__, *_verify.__all__]
