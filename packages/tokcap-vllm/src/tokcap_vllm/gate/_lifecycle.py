"""The lifecycle of one captured call inside the gate: transitions, refusals and effects.

    PLANNING --admit--> ADMITTED --finish--> FINISHED --respond--> RESPONDED --commit--> COMMITTED
    PLANNING --drop--> DROPPED                            RESPONDED --fail--> FAILED (served)
    ADMITTED | FINISHED --abandon--> ABANDONED (Failed(served=False) in the ledger)
    ABANDONED --finish | respond--> ABANDONED (the engine or the response went on; ignored)

Invariants:
- a call is PLANNING from the moment its request is read until its ``Admitted`` entry is
  appended (it holds its idempotency key and request id meanwhile); a refused plan DROPs
  it and the ledger never hears of it;
- the engine's final output (``finish``) starts the sink write at once; the call becomes a
  parent only after its response's last byte (``respond``), and is COMMITTED only once the
  sink acknowledged it and ``Staged`` is in the ledger;
- a call whose response never completed, or that was still in flight when its rollout
  closed, is ABANDONED: never a parent, never committed, its staged row (if any) cleared,
  and its request ended (``abandoned`` is set) so the harness never gets a completion;
- COMMITTED, FAILED, DROPPED and ABANDONED are final: ``settled`` is set exactly once.
What each step does to its rollout (claims, the live set, the parent index, the rollout's
phase) is `EFFECTS`, applied by `tokcap_vllm.gate._rollouts.RolloutBook.step`. An operation the
table does not allow raises `CallStateError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

from tokcap_core.states import Sentinel

from ..errors import CallStateError

__all__ = [
    "ABANDONED",
    "ADMITTED",
    "COMMITTED",
    "DROPPED",
    "EFFECTS",
    "FAILED",
    "FINAL",
    "FINISHED",
    "PLANNING",
    "RESPONDED",
    "CallPhase",
    "CallStateError",
    "next_phase",
]


class CallPhase(Sentinel):
    """A captured call's phase (compare with ``is``)."""

    __slots__ = ()


PLANNING: Final = CallPhase("PLANNING")
ADMITTED: Final = CallPhase("ADMITTED")
FINISHED: Final = CallPhase("FINISHED")
RESPONDED: Final = CallPhase("RESPONDED")
COMMITTED: Final = CallPhase("COMMITTED")
FAILED: Final = CallPhase("FAILED")
DROPPED: Final = CallPhase("DROPPED")
ABANDONED: Final = CallPhase("ABANDONED")

FINAL: Final = frozenset({COMMITTED, FAILED, DROPPED, ABANDONED})
TRANSITIONS: Final[Mapping[CallPhase, Mapping[str, CallPhase]]] = {
    PLANNING: {"admit": ADMITTED, "drop": DROPPED},
    ADMITTED: {"finish": FINISHED, "abandon": ABANDONED},
    FINISHED: {"respond": RESPONDED, "abandon": ABANDONED},
    RESPONDED: {"commit": COMMITTED, "fail": FAILED},
    COMMITTED: {},
    FAILED: {},
    DROPPED: {},
    ABANDONED: {"finish": ABANDONED, "respond": ABANDONED},
}
REFUSALS: Final[Mapping[CallPhase, Mapping[str, str]]] = {
    PLANNING: dict.fromkeys(("finish", "respond", "commit", "fail", "abandon"), "not_admitted"),
    ADMITTED: {"admit": "already_admitted", "drop": "already_admitted"}
    | dict.fromkeys(("respond", "commit", "fail"), "not_finished"),
    FINISHED: dict.fromkeys(("admit", "drop", "finish"), "already_finished")
    | dict.fromkeys(("commit", "fail"), "not_responded"),
    RESPONDED: dict.fromkeys(("admit", "drop", "finish", "respond", "abandon"), "responded"),
    **{
        phase: dict.fromkeys(
            ("admit", "drop", "finish", "respond", "commit", "fail", "abandon"), "settled"
        )
        for phase in (COMMITTED, FAILED, DROPPED)
    },
    ABANDONED: dict.fromkeys(("admit", "drop", "commit", "fail", "abandon"), "settled"),
}
# What each call step does to its rollout (only when the phase changes).
EFFECTS: Final[Mapping[str, tuple[str, ...]]] = {
    "admit": ("index_call",),
    "drop": ("release_claims", "leave", "forget_if_idle"),
    "finish": (),
    "respond": ("index_parent",),
    "commit": ("leave",),
    "fail": ("leave", "unindex_parent", "uncapture"),
    "abandon": ("leave", "release_claims", "signal_abandoned"),
}


_Phase = TypeVar("_Phase")


def next_phase(
    phase: _Phase,
    op: str,
    transitions: Mapping[_Phase, Mapping[str, _Phase]],
    refusals: Mapping[_Phase, Mapping[str, str]],
) -> _Phase:
    """The phase ``op`` leads to from ``phase``; `CallStateError` (with the refusal's code)
    if the table does not allow it."""
    nxt = transitions[phase].get(op)
    if nxt is None:
        raise CallStateError(refusals[phase].get(op, "unknown_op"), f"{op} in phase {phase}")
    return nxt
