"""Receipts: the verified chain of staged calls a rollout trains on, and staged-row checks."""

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
    "Receipt",
    "ReceiptCall",
    "SegmentMode",
    "TerminalSelection",
    "assemble_receipt",
    "verify_staged",
]
