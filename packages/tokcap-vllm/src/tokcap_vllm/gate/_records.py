"""What the gate's rollout book moves: the records of a rollout and of its calls, and the
tables of their phases (pure data; `tokcap_vllm.gate._rollouts.RolloutBook` applies them, one
event at a time). A rollout and its calls refer to each other, so both records live here.
A rollout::

    EMPTY --append--> OPEN --fail--> UNCAPTURED
    EMPTY --open--> OPEN (opened explicitly: held and closable before its first call)
    OPEN --close--> CLOSING --closed--> CLOSED (its ledger kept until released)
    UNCAPTURED --close--> CLOSING_UNCAPTURED --closed--> CLOSED
    CLOSING --fail--> CLOSING_UNCAPTURED
    CLOSING --reopen--> OPEN, CLOSING_UNCAPTURED --reopen--> UNCAPTURED (the close failed)

A call::

    PLANNING --admit--> ADMITTED --finish--> FINISHED --respond--> RESPONDED --commit--> COMMITTED
    PLANNING --drop--> DROPPED                            RESPONDED --fail--> FAILED (served)
    ADMITTED | FINISHED --abandon--> ABANDONED (Failed(served=False) in the ledger)
    ADMITTED | FINISHED | RESPONDED --contain--> CONTAINED (a failure inside the gate)
    ABANDONED | CONTAINED --finish | respond--> itself (the engine or the response went on; ignored)

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
- a call one of whose background steps failed inside the gate is CONTAINED: its rollout is
  poisoned (the book's ``call_contained``), it is never answered nor committed, and it
  keeps its claims (a retry under its key takes it over); containing a call that already
  settled changes no call, only its rollout;
- COMMITTED, FAILED, DROPPED, ABANDONED and CONTAINED are final: ``settled`` is set exactly
  once.
What each call step does to its rollout (claims, the live set, the parent index, the
rollout's phase) is `EFFECTS`. An operation a table does not allow raises `CallStateError`
(`next_phase`) and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from tokcap_core import Ledger, StagedCall
from tokcap_core.ids import CallId, RolloutId
from tokcap_core.ledger import OPEN as LEDGER_OPEN
from tokcap_core.states import Sentinel

from ..errors import CallStateError
from ._planning import ParentIndex

if TYPE_CHECKING:
    from ._host import EngineResult
    from ._planning import ChatPlan, PlannedRequest, PriorCall

__all__ = [
    "ABANDONED",
    "ADMITTED",
    "CLOSED",
    "CLOSING",
    "CLOSING_UNCAPTURED",
    "COMMITTED",
    "CONTAINED",
    "DROPPED",
    "EFFECTS",
    "EMPTY",
    "FAILED",
    "FINAL",
    "FINISHED",
    "HELD",
    "IN_CLOSE",
    "OPEN",
    "PLANNING",
    "REFUSALS",
    "RESPONDED",
    "ROLLOUT_REFUSALS",
    "ROLLOUT_TRANSITIONS",
    "TRANSITIONS",
    "UNCAPTURED",
    "CallPhase",
    "Flag",
    "GateCall",
    "ResponsesTurn",
    "RolloutPhase",
    "RolloutRecord",
    "answerable",
    "gone",
    "next_phase",
]


class RolloutPhase(Sentinel):
    """A rollout's phase in the gate (compare with ``is``)."""

    __slots__ = ()


EMPTY: Final = RolloutPhase("EMPTY")
OPEN: Final = RolloutPhase("OPEN")
UNCAPTURED: Final = RolloutPhase("UNCAPTURED")
CLOSING: Final = RolloutPhase("CLOSING")
CLOSING_UNCAPTURED: Final = RolloutPhase("CLOSING_UNCAPTURED")
CLOSED: Final = RolloutPhase("CLOSED")

IN_CLOSE: Final = frozenset({CLOSING, CLOSING_UNCAPTURED})
HELD: Final = frozenset({OPEN, UNCAPTURED, CLOSING, CLOSING_UNCAPTURED})
"""Phases in which a rollout is listed, counted and has a ledger to serve."""

ROLLOUT_TRANSITIONS: Final[Mapping[RolloutPhase, Mapping[str, RolloutPhase]]] = {
    EMPTY: {"append": OPEN, "fail": UNCAPTURED, "open": OPEN},
    OPEN: {"append": OPEN, "fail": UNCAPTURED, "close": CLOSING, "open": OPEN},
    UNCAPTURED: {
        "append": UNCAPTURED,
        "fail": UNCAPTURED,
        "close": CLOSING_UNCAPTURED,
        "open": UNCAPTURED,
    },
    CLOSING: {"append": CLOSING, "fail": CLOSING_UNCAPTURED, "closed": CLOSED, "reopen": OPEN},
    CLOSING_UNCAPTURED: {
        "append": CLOSING_UNCAPTURED,
        "fail": CLOSING_UNCAPTURED,
        "closed": CLOSED,
        "reopen": UNCAPTURED,
    },
    CLOSED: {"fail": CLOSED},  # a late failure of a call the close already settled
}
ROLLOUT_REFUSALS: Final[Mapping[RolloutPhase, Mapping[str, str]]] = {
    EMPTY: dict.fromkeys(("close", "closed", "reopen"), "not_open"),
    OPEN: dict.fromkeys(("closed", "reopen"), "not_closing"),
    UNCAPTURED: dict.fromkeys(("closed", "reopen"), "not_closing"),
    CLOSING: dict.fromkeys(("close", "open"), "rollout_closed"),
    CLOSING_UNCAPTURED: dict.fromkeys(("close", "open"), "rollout_closed"),
    CLOSED: dict.fromkeys(("append", "close", "closed", "reopen", "open"), "rollout_closed"),
}


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
CONTAINED: Final = CallPhase("CONTAINED")

FINAL: Final = frozenset({COMMITTED, FAILED, DROPPED, ABANDONED, CONTAINED})
TRANSITIONS: Final[Mapping[CallPhase, Mapping[str, CallPhase]]] = {
    PLANNING: {"admit": ADMITTED, "drop": DROPPED},
    ADMITTED: {"finish": FINISHED, "abandon": ABANDONED, "contain": CONTAINED},
    FINISHED: {"respond": RESPONDED, "abandon": ABANDONED, "contain": CONTAINED},
    RESPONDED: {"commit": COMMITTED, "fail": FAILED, "contain": CONTAINED},
    COMMITTED: {"contain": COMMITTED},
    FAILED: {"contain": FAILED},
    DROPPED: {"contain": DROPPED},
    ABANDONED: {"finish": ABANDONED, "respond": ABANDONED, "contain": ABANDONED},
    CONTAINED: {"finish": CONTAINED, "respond": CONTAINED, "contain": CONTAINED},
}
_SETTLED = ("admit", "drop", "finish", "respond", "commit", "fail", "abandon")
REFUSALS: Final[Mapping[CallPhase, Mapping[str, str]]] = {
    PLANNING: dict.fromkeys(
        ("finish", "respond", "commit", "fail", "abandon", "contain"), "not_admitted"
    ),
    ADMITTED: {"admit": "already_admitted", "drop": "already_admitted"}
    | dict.fromkeys(("respond", "commit", "fail"), "not_finished"),
    FINISHED: dict.fromkeys(("admit", "drop", "finish"), "already_finished")
    | dict.fromkeys(("commit", "fail"), "not_responded"),
    RESPONDED: dict.fromkeys(("admit", "drop", "finish", "respond", "abandon"), "responded"),
    **{phase: dict.fromkeys(_SETTLED, "settled") for phase in (COMMITTED, FAILED, DROPPED)},
    **{
        phase: dict.fromkeys(("admit", "drop", "commit", "fail", "abandon"), "settled")
        for phase in (ABANDONED, CONTAINED)
    },
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
    "contain": ("leave", "signal_sink_done"),
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


@dataclass(slots=True, eq=False)
class ResponsesTurn:
    """One captured Responses call, as its children's ``previous_response_id`` sees it."""

    previous: ResponsesTurn | None
    """The turn named by this call's ``previous_response_id`` (None: none named)."""
    input_items: list[Any]
    """This request's own input items (a text input as one user message)."""
    output_items: list[Any] | None = None
    """The output items the harness received (set when the call responded)."""

    def history(self) -> list[Any]:
        """Every input and output item of the chain up to this turn, oldest first."""
        chain: list[ResponsesTurn] = []
        turn: ResponsesTurn | None = self
        while turn is not None:
            chain.append(turn)
            turn = turn.previous
        items: list[Any] = []
        for each in reversed(chain):
            items += each.input_items
            items += each.output_items or []
        return items


@dataclass(slots=True, eq=False)
class RolloutRecord:
    """An open rollout: its ledger, its calls and its parent index."""

    rollout_id: RolloutId
    ledger: Ledger
    lock: AbstractAsyncContextManager[Any]
    """The driver's lock around planning (opaque here)."""
    phase: RolloutPhase = EMPTY
    poison: str | None = None
    """Pending: the close appends ``Poisoned(poison)`` instead of ``Closed``."""
    calls: dict[CallId, GateCall] = field(default_factory=dict)
    """Admitted calls, by call id."""
    live: set[GateCall] = field(default_factory=set)
    """Calls not yet final nor contained (PLANNING ones included)."""
    parents: ParentIndex = field(default_factory=ParentIndex)
    keys: dict[str, GateCall] = field(default_factory=dict)
    """Idempotency key → the call that holds it."""
    request_ids: dict[str, GateCall] = field(default_factory=dict)
    """Request id → the call that used it (ids name responses, so they are unique)."""

    @property
    def accepting(self) -> bool:
        """Whether new calls may be admitted (open in the ledger and not closing)."""
        return self.phase not in IN_CLOSE and self.ledger.status is LEDGER_OPEN

    @property
    def held(self) -> bool:
        """Whether the rollout is listed and has a ledger to serve (not EMPTY, not gone)."""
        return self.phase in HELD


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
    thread: ResponsesTurn | None = None
    """A Responses call's items, for a later ``previous_response_id`` naming it."""
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
        return self.phase in FINAL

    @property
    def in_flight(self) -> bool:
        """Admitted and not yet responded: still generating or still sending its response."""
        return self.phase is ADMITTED or self.phase is FINISHED


def gone(call: GateCall) -> bool:
    """Whether a call left without an answer (dropped or abandoned): its key is free."""
    return call.phase is ABANDONED or call.phase is DROPPED


def answerable(call: GateCall) -> bool:
    """Whether a key holder settled with a recorded answer to send a retry again."""
    return call.answer is not None and (call.phase is COMMITTED or call.phase is FAILED)
