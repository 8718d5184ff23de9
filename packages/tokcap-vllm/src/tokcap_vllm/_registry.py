"""The rollouts one gate holds: open ones (with their live calls) and closed ledgers.

A rollout id names at most one `RolloutRecord` at a time. A record is made when the
first request of a rollout arrives and forgotten again if that request never got a call
admitted (so refused requests leave nothing behind); a closed rollout keeps only its
ledger until it is released, after which the id may start a new, unrelated record.
Calls hold their record itself, never its id: a call of a released rollout can never
reach the record that reuses the id. The number of open records is bounded.

The registry is bookkeeping only: entries are appended by the gate (`Gate._append`),
which also tells its observers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import anyio

from tokcap_core import Ledger
from tokcap_core.ids import CallId, RolloutId, validate_rollout_id
from tokcap_core.ledger import OPEN

from ._admission import PriorCall
from ._errors import RolloutConflict, RolloutNotFound, TooManyRollouts
from ._lifecycle import GateCall

__all__ = ["RolloutRecord", "RolloutRegistry"]


@dataclass(slots=True, eq=False)
class RolloutRecord:
    """An open rollout: its ledger, its calls and what admission needs to know of them."""

    rollout_id: RolloutId
    ledger: Ledger
    calls: dict[CallId, GateCall] = field(default_factory=dict)
    """Admitted calls, by call id."""
    live: set[GateCall] = field(default_factory=set)
    """Calls not yet in a final phase (PLANNING ones included)."""
    priors: list[PriorCall] = field(default_factory=list)
    """Responded calls that may be parents, oldest first."""
    gen_starts: dict[CallId, int] = field(default_factory=dict)
    keys: dict[str, GateCall] = field(default_factory=dict)
    """Idempotency key → the call that holds it."""
    request_ids: dict[str, GateCall] = field(default_factory=dict)
    """Request id → the call that used it (ids name responses, so they are unique)."""
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    closing: bool = False
    uncaptured_reason: str | None = None
    """Set once the rollout cannot verify: its later calls pass uncaptured."""
    poison_reason: str | None = None
    """A failure outside any one call (the ledger file): the close appends ``Poisoned``."""
    opened: bool = False
    """Opened explicitly (``POST …/open``): held, and closable, before its first call."""

    @property
    def accepting(self) -> bool:
        """Whether new calls may be admitted (open in the ledger and not closing)."""
        return not self.closing and self.ledger.status is OPEN


class RolloutRegistry:
    """Open records and closed ledgers, by rollout id (``max_open`` bounds the open ones)."""

    def __init__(self, *, max_open: int) -> None:
        self.max_open = max_open
        self._open: dict[RolloutId, RolloutRecord] = {}
        self._closed: dict[RolloutId, Ledger] = {}

    def join(self, rollout_id: str, *, require_open: bool = False) -> RolloutRecord:
        """The open record a new request joins, made on first use.

        `RolloutConflict` (409) if the id names a closed (or closing) rollout;
        `TooManyRollouts` (503) when ``max_open`` records are open already;
        with ``require_open``, `RolloutNotFound` (``unknown_rollout``) unless it was opened.
        """
        rid = validate_rollout_id(rollout_id)
        if rid in self._closed:
            raise RolloutConflict("rollout_closed", f"{rid} is closed; start a new rollout id")
        record = self._open.get(rid)
        if require_open and (record is None or not record.opened):
            raise RolloutNotFound(
                "unknown_rollout",
                f"{rid} was not opened on this gate (POST /tokcap/v1/rollouts/{rid}/open)",
            )
        if record is None:
            if len(self._open) >= self.max_open:
                raise TooManyRollouts(
                    "too_many_open_rollouts",
                    f"{self.max_open} rollouts are open; close some before starting more",
                )
            record = self._open[rid] = RolloutRecord(rid, Ledger(rid))
        elif record.closing:
            raise RolloutConflict("rollout_closed", f"{rid} is closing")
        return record

    def open(self, rollout_id: str) -> RolloutRecord:
        """Open a rollout explicitly (made if new; opening it again changes nothing)."""
        record = self.join(rollout_id)
        record.opened = True
        return record

    def forget_if_idle(self, record: RolloutRecord) -> None:
        """Drop an open record that never admitted a call, has no live call left and was
        not opened explicitly."""
        if (
            not record.opened
            and not record.ledger.head[0]
            and not record.live
            and self._open.get(record.rollout_id) is record
        ):
            del self._open[record.rollout_id]

    def open_record(self, rollout_id: str) -> RolloutRecord:
        """The open record of ``rollout_id``: `RolloutNotFound` / `RolloutConflict` if not open."""
        rid = validate_rollout_id(rollout_id)
        record = self._open.get(rid)
        if record is None or not (record.ledger.head[0] or record.opened):
            if rid in self._closed:
                raise RolloutConflict("rollout_closed", f"{rid} is closed")
            raise RolloutNotFound("unknown_rollout", f"no open rollout {rid}")
        if record.closing:
            raise RolloutConflict("rollout_closed", f"{rid} is closing")
        return record

    def ledger(self, rollout_id: str) -> Ledger:
        """The ledger of an open or closed rollout; `RolloutNotFound` otherwise."""
        rid = validate_rollout_id(rollout_id)
        record = self._open.get(rid)
        if record is not None and record.ledger.head[0]:
            return record.ledger
        if rid in self._closed:
            return self._closed[rid]
        raise RolloutNotFound("unknown_rollout", f"no rollout {rid}")

    def states(self) -> dict[RolloutId, str]:
        """Every rollout held with at least one entry, ``{rollout_id: "open" | "closed"}``."""
        held = {rid: "closed" for rid in self._closed}
        held.update({rid: "open" for rid, r in self._open.items() if r.ledger.head[0]})
        return held

    def counts(self) -> tuple[int, int]:
        """``(open, closed)`` rollouts held (open ones with at least one entry)."""
        return sum(1 for r in self._open.values() if r.ledger.head[0]), len(self._closed)

    def records(self) -> list[RolloutRecord]:
        """Every open record."""
        return list(self._open.values())

    def mark_closed(self, record: RolloutRecord) -> None:
        """Move a record whose ledger just closed to the closed ledgers."""
        if self._open.get(record.rollout_id) is record:
            del self._open[record.rollout_id]
        self._closed[record.rollout_id] = record.ledger

    def release(self, rollout_id: str) -> None:
        """Forget a closed rollout; `RolloutConflict` if open, `RolloutNotFound` if unknown."""
        rid = validate_rollout_id(rollout_id)
        if rid in self._open and self._open[rid].ledger.head[0]:
            raise RolloutConflict("rollout_open", f"{rid} is open; close it first")
        if self._closed.pop(rid, None) is None:
            raise RolloutNotFound("unknown_rollout", f"no closed rollout {rid}")

    def adopt(self, ledgers: Iterable[Ledger]) -> list[RolloutRecord]:
        """Take back stored ledgers after a restart: closed ones are served as they were.

        Returns records for the ledgers that were still open, for the gate to poison and
        close (their in-flight calls are gone; they are never resumed).
        """
        reopened = []
        for ledger in ledgers:
            rid = validate_rollout_id(ledger.rollout_id)
            if ledger.status is OPEN:
                reopened.append(RolloutRecord(rid, ledger))
            else:
                self._closed[rid] = ledger
        return reopened

    def held_ledgers(self) -> list[Ledger]:
        """Every ledger held, open and closed (what a ledger-file compaction keeps)."""
        return [*self._closed.values(), *(r.ledger for r in self._open.values())]
