"""Receipts: the verified chain of staged calls a rollout trains on, staged-row checks, and
what a receipt leaves uncovered."""

from . import _coverage, _receipt
from ._coverage import *  # noqa: F403
from ._reassembly import verify_staged
from ._receipt import *  # noqa: F403

__all__ = [*_coverage.__all__, *_receipt.__all__, "verify_staged"]
