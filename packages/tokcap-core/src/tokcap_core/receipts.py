"""Receipts: the verified chain of staged calls a rollout trains on, staged-row checks, and
what a receipt leaves uncovered."""

from ._coverage import (
    UNCOVERED_REASONS,
    StagedMatch,
    Uncovered,
    UncoveredReason,
    uncovered_calls,
)
from ._receipt import (
    SEGMENT_MODES,
    TERMINAL_SELECTIONS,
    Receipt,
    ReceiptCall,
    SegmentMode,
    TerminalSelection,
    assemble_receipt,
)
from ._verify import (
    verify_staged,
)

__all__ = [
    "SEGMENT_MODES",
    "TERMINAL_SELECTIONS",
    "UNCOVERED_REASONS",
    "Receipt",
    "ReceiptCall",
    "SegmentMode",
    "StagedMatch",
    "TerminalSelection",
    "Uncovered",
    "UncoveredReason",
    "assemble_receipt",
    "uncovered_calls",
    "verify_staged",
]
