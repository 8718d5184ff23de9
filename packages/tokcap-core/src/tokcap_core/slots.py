"""Replay-buffer slots in capture mode: a pure state machine over groups of rollouts."""

from ._replay import (
    READY,
    RESERVED,
    ClearPlan,
    ReplaySlots,
    Slot,
    SlotState,
)

__all__ = [
    "READY",
    "RESERVED",
    "ClearPlan",
    "ReplaySlots",
    "Slot",
    "SlotState",
]
