"""The lifecycle of one captured call inside the gate: a transitions-and-refusals table.

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
  closed, is ABANDONED: never a parent, never committed, its staged row (if any) cleared;
- COMMITTED, FAILED, DROPPED and ABANDONED are final: ``settled`` is set exactly once.
An operation the table does not allow raises `CallStateError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio

from tokcap_core import StagedCall, TokcapError
from tokcap_core.ids import CallId, RolloutId

if TYPE_CHECKING:
    from ._admission import ChatPlan, PriorCall
    from ._host import EngineResult

__all__ = [
    "ABANDONED",
    "ADMITTED",
    "COMMITTED",
    "DROPPED",
    "FAILED",
    "FINISHED",
    "PLANNING",
    "RESPONDED",
    "CallPhase",
    "CallStateError",
    "GateCall",
]


class CallPhase:
    """A captured call's phase (compare with ``is``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


PLANNING: Final = CallPhase("PLANNING")
ADMITTED: Final = CallPhase("ADMITTED")
FINISHED: Final = CallPhase("FINISHED")
RESPONDED: Final = CallPhase("RESPONDED")
COMMITTED: Final = CallPhase("COMMITTED")
FAILED: Final = CallPhase("FAILED")
DROPPED: Final = CallPhase("DROPPED")
ABANDONED: Final = CallPhase("ABANDONED")

_FINAL: Final = frozenset({COMMITTED, FAILED, DROPPED, ABANDONED})

_TRANSITIONS: Final[Mapping[CallPhase, Mapping[str, CallPhase]]] = {
    PLANNING: {"admit": ADMITTED, "drop": DROPPED},
    ADMITTED: {"finish": FINISHED, "abandon": ABANDONED},
    FINISHED: {"respond": RESPONDED, "abandon": ABANDONED},
    RESPONDED: {"commit": COMMITTED, "fail": FAILED},
    COMMITTED: {},
    FAILED: {},
    DROPPED: {},
    ABANDONED: {"finish": ABANDONED, "respond": ABANDONED},
}
_REFUSALS: Final[Mapping[CallPhase, Mapping[str, str]]] = {
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


class CallStateError(TokcapError, RuntimeError):
    """The gate asked a call for a step its phase does not allow (a gate bug, contained)."""


@dataclass(slots=True, eq=False)
class GateCall:
    """The gate's working record of one captured request, from its body to its commit.

    ``rollout`` is the registry record the call joined (never looked up again by id, so a
    released and reused rollout id can never receive this call). Tokens live here until
    the ledger commits the call; the sink holds them from ``finish`` on.
    """

    rollout: Any
    """The `tokcap_vllm._registry.RolloutRecord` this call belongs to."""
    kind: str
    idempotency_key: str | None = None
    body_fingerprint: str = ""
    request_id: str | None = None
    phase: CallPhase = PLANNING
    call_id: CallId | None = None
    plan: ChatPlan | None = None
    parent: GateCall | None = None
    result: EngineResult | None = None
    staged: StagedCall | None = None
    stage_error: str | None = None
    prior: PriorCall | None = None
    response_id: str | None = None
    output_fp: str | None = None
    replay: tuple[dict[str, Any], list[bytes]] | None = None
    sink_done: anyio.Event = field(default_factory=anyio.Event)
    settled: anyio.Event = field(default_factory=anyio.Event)

    @property
    def rollout_id(self) -> RolloutId:
        """The id of the rollout this call belongs to."""
        rollout_id: RolloutId = self.rollout.rollout_id
        return rollout_id

    @property
    def final(self) -> bool:
        """Whether the call reached a final phase (its ``settled`` event is set)."""
        return self.phase in _FINAL

    @property
    def in_flight(self) -> bool:
        """Admitted and not yet responded: still generating or still sending its response."""
        return self.phase is ADMITTED or self.phase is FINISHED

    def step(self, op: str) -> CallPhase:
        """Apply ``op``; raise `CallStateError` (and change nothing) if the table refuses it."""
        nxt = _TRANSITIONS[self.phase].get(op)
        if nxt is None:
            code = _REFUSALS[self.phase].get(op, "unknown_op")
            raise CallStateError(code, f"{op} of call {self.call_id} in phase {self.phase}")
        self.phase = nxt
        if nxt in _FINAL:
            self.settled.set()
        return nxt
