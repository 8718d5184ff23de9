"""The records the gate's tables move: a rollout (`RolloutRecord`) and a call (`GateCall`).

Pure data, no rules: the rollout-phase table lives in `tokcap_vllm.gate._rollouts`, the call
table in `tokcap_vllm.gate._lifecycle`; a rollout and its calls refer to each other, so both
records live here (no import circle between the tables' modules).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from tokcap_core import Ledger, StagedCall
from tokcap_core.ids import CallId, RolloutId
from tokcap_core.ledger import OPEN as LEDGER_OPEN
from tokcap_core.states import Sentinel

from ._lifecycle import (
    ABANDONED,
    ADMITTED,
    COMMITTED,
    DROPPED,
    FAILED,
    FINAL,
    FINISHED,
    PLANNING,
    CallPhase,
)
from ._planning import ParentIndex

if TYPE_CHECKING:
    from ._host import EngineResult
    from ._planning import ChatPlan, PlannedRequest, PriorCall

__all__ = [
    "CLOSED",
    "CLOSING",
    "CLOSING_UNCAPTURED",
    "EMPTY",
    "HELD",
    "IN_CLOSE",
    "OPEN",
    "UNCAPTURED",
    "Flag",
    "GateCall",
    "ResponsesTurn",
    "RolloutPhase",
    "RolloutRecord",
    "answerable",
    "gone",
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
