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
phase) is `EFFECTS`, applied by `tokcap_vllm._rollouts.RolloutBook.step`. An operation the
table does not allow raises `CallStateError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from tokcap_core import StagedCall, TokcapError
from tokcap_core.ids import CallId, RolloutId
from tokcap_core.states import Sentinel

if TYPE_CHECKING:
    from ._admission import ChatPlan, PriorCall
    from ._host import EngineResult
    from ._planning import PlannedRequest
    from ._rollouts import RolloutRecord

__all__ = [
    "ABANDONED",
    "ADMITTED",
    "COMMITTED",
    "DROPPED",
    "EFFECTS",
    "FAILED",
    "FINISHED",
    "PLANNING",
    "RESPONDED",
    "CallPhase",
    "CallStateError",
    "Flag",
    "GateCall",
    "answerable",
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

_FINAL: Final = frozenset({COMMITTED, FAILED, DROPPED, ABANDONED})
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


class CallStateError(TokcapError, RuntimeError):
    """The gate asked a call or a rollout for a step its phase does not allow (a gate bug,
    contained)."""


class Flag(Protocol):
    """What the driver waits on (an ``anyio.Event``); the rules only set it."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> None: ...


@dataclass(slots=True, eq=False)
class GateCall:
    """The gate's working record of one captured request, from its body to its commit.

    ``rollout`` is the record the call joined (never looked up again by id, so a released
    and reused rollout id can never receive this call). Tokens live here until the ledger
    commits the call; the sink holds them from ``finish`` on.
    """

    rollout: RolloutRecord
    kind: str
    sink_done: Flag
    settled: Flag
    idempotency_key: str | None = None
    body_fingerprint: str = ""
    request_id: str | None = None
    phase: CallPhase = PLANNING
    call_id: CallId | None = None
    request: PlannedRequest | None = None
    plan: ChatPlan | None = None
    parent: GateCall | None = None
    result: EngineResult | None = None
    staged: StagedCall | None = None
    stage_error: str | None = None
    prior: PriorCall | None = None
    response_id: str | None = None
    output_fp: str | None = None
    answer: tuple[dict[str, Any], list[bytes]] | None = None
    abandoned: Flag | None = None
    """Set when the call is abandoned: its request, if still running, is then ended (the
    engine stops generating; the harness gets an error, never a completion)."""

    @property
    def rollout_id(self) -> RolloutId:
        """The id of the rollout this call belongs to."""
        return self.rollout.rollout_id

    @property
    def final(self) -> bool:
        """Whether the call reached a final phase (its ``settled`` flag is set)."""
        return self.phase in _FINAL

    @property
    def in_flight(self) -> bool:
        """Admitted and not yet responded: still generating or still sending its response."""
        return self.phase is ADMITTED or self.phase is FINISHED


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


def gone(call: GateCall) -> bool:
    """Whether a call left without an answer (dropped or abandoned): its key is free."""
    return call.phase is ABANDONED or call.phase is DROPPED


def answerable(call: GateCall) -> bool:
    """Whether a key holder settled with a recorded answer to send a retry again."""
    return call.answer is not None and (call.phase is COMMITTED or call.phase is FAILED)
