"""The rollout book: the one owner of every event of one gate's rollouts and their calls.

No I/O, no engine, no clock, no task group (as h11's ``ConnectionState``): the drivers
(`tokcap_vllm.gate._capture.CapturePath` for a call, `tokcap_vllm.gate._gate.Gate` for the control
operations) tell the book what happened, one method per event, and do what it answers.
An event checks what the tables (`tokcap_vllm.gate._records`) allow, appends its own ledger
entry and moves the rollout and its calls on, in one step, or raises and changes nothing;
it returns what the driver does next: the `Entry` to tell the observers, the call to
abandon or wait for, the refusal to answer with. A call's events are
`tokcap_vllm.gate._lifecycle.CallEvents`; a rollout's (open, terminal, close, release, restore)
are here, with what the book holds. The flags and locks the driver waits on are made by
factories it passes in.

Invariants:
- a rollout id names at most one open record; an EMPTY record (no entry) is forgotten
  when its last live call is dropped, so a refused request leaves nothing behind; a
  CLOSED rollout keeps only its ledger until released; calls hold their record, never
  its id, so a call of a released rollout can never reach a record reusing the id;
- the number of open records is bounded (``max_open``);
- an UNCAPTURED rollout (a call of it failed) refuses its later calls
  (``rollout_poisoned``); an OPEN rollout none of whose calls was served is forgotten
  when vLLM refuses a call of it (`call_unserved`); a pending *poison* (a contained call,
  an entry the observers could not persist) makes its close ``Poisoned``, not ``Closed``;
- a call holds its idempotency key and request id from its claim until it is dropped or
  abandoned; it is *live* until final; it is a parent (in the rollout's `ParentIndex`)
  from its response until it fails.

Who holds each rollout, and when a holder counts as gone (`Owners`, ``RolloutBook.owners``).
A rollout opened with an owner (``X-Tokcap-Owner``: a `GateFleet`'s owner token) belongs
to it: opening, declaring the terminal, closing and releasing it are refused to anyone
else (409 ``rollout_owned``), so a second trainer on the same gates can neither close,
release nor reclaim a live trainer's rollouts, nor open one of its ids as its own. A
rollout opened without an owner is anyone's (the single-trainer case, and header-routed
rollouts nobody opened).

An owner is *live* while it keeps talking: every control request it signs renews it (the
driver calls `Owners.touch` with its clock). Once an owner has been silent for longer than
the lease (``GateConfig.owner_lease_s``), whoever asks next takes its rollouts over: what
a restarted trainer's reclaim needs, without ever taking from a trainer that still talks.
No I/O and no clock here: the time comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from tokcap_core import Entry, Ledger
from tokcap_core.ids import RolloutId, validate_rollout_id
from tokcap_core.ledger import OPEN as LEDGER_OPEN
from tokcap_core.ledger import Admitted, Closed, Failed, Poisoned, TerminalDeclared, Witnesses
from tokcap_core.reasons import GATE_RESTARTED, make_reason

from ..errors import InvalidBody, RolloutConflict, RolloutNotFound
from ._lifecycle import Abandoned, CallEvents
from ._records import (
    ADMITTED,
    CLOSED,
    CLOSING,
    CLOSING_UNCAPTURED,
    COMMITTED,
    EMPTY,
    FAILED,
    FINISHED,
    HELD,
    IN_CLOSE,
    OPEN,
    RESPONDED,
    UNCAPTURED,
    Flag,
    GateCall,
    RolloutPhase,
    RolloutRecord,
)

__all__ = [
    "CLOSED",
    "CLOSING",
    "CLOSING_UNCAPTURED",
    "EMPTY",
    "OPEN",
    "UNCAPTURED",
    "Abandon",
    "Abandoned",
    "Owners",
    "RolloutBook",
    "RolloutPhase",
    "RolloutRecord",
    "Settle",
]


@dataclass(frozen=True, slots=True)
class Abandon:
    """What a close does next: abandon this call, still in flight."""

    call: GateCall


@dataclass(frozen=True, slots=True)
class Settle:
    """What a close does next: wait until this responded call is committed or failed."""

    call: GateCall


class RolloutBook(CallEvents):
    """Every rollout one gate holds, open and closed: each event of them and of their calls."""

    def __init__(
        self,
        *,
        max_open: int,
        flag: Callable[[], Flag],
        lock: Callable[[], AbstractAsyncContextManager[Any]],
        owner_lease_s: float = 600.0,
    ) -> None:
        super().__init__(max_open=max_open, flag=flag, lock=lock)
        self.owners = Owners(owner_lease_s)
        """Who holds each owned rollout."""

    # ---- what the book holds ----------------------------------------------------------

    def ledger(self, rollout_id: str) -> Ledger:
        """The ledger of an open or closed rollout; `RolloutNotFound` otherwise."""
        rid = validate_rollout_id(rollout_id)
        record = self._open.get(rid)
        if record is not None and record.phase in HELD:
            return record.ledger
        if rid in self._closed:
            return self._closed[rid]
        raise RolloutNotFound("unknown_rollout", f"no rollout {rid}")

    def open_record(self, rollout_id: str) -> RolloutRecord:
        """The open record of ``rollout_id``: `RolloutNotFound` / `RolloutConflict` if not open."""
        rid = validate_rollout_id(rollout_id)
        record = self._open.get(rid)
        if record is None or record.phase not in HELD:
            if rid in self._closed:
                raise RolloutConflict("rollout_closed", f"{rid} is closed")
            raise RolloutNotFound("unknown_rollout", f"no open rollout {rid}")
        if record.phase in IN_CLOSE:
            raise RolloutConflict("rollout_closed", f"{rid} is closing")
        return record

    def holders(self) -> dict[RolloutId, str]:
        """``{rollout_id: owner}`` of every owned rollout held."""
        return {rid: o for rid in self.states() if (o := self.owners.of(rid)) is not None}

    def states(self) -> dict[RolloutId, str]:
        """Every rollout held, ``{rollout_id: "open" | "closed"}``."""
        held = dict.fromkeys(self._closed, "closed")
        held.update({rid: "open" for rid, r in self._open.items() if r.phase in HELD})
        return held

    def counts(self) -> tuple[int, int]:
        """``(open, closed)`` rollouts held."""
        return sum(1 for r in self._open.values() if r.phase in HELD), len(self._closed)

    def records(self) -> list[RolloutRecord]:
        """Every open record."""
        return list(self._open.values())

    def held_ledgers(self) -> list[Ledger]:
        """Every ledger held, open and closed (what a ledger-file compaction keeps)."""
        return [*self._closed.values(), *(r.ledger for r in self._open.values())]

    def unsettled(self, rollout_id: str | None = None) -> list[GateCall]:
        """The calls (of ``rollout_id``, or of every open rollout) the engine finished that
        are not committed or failed yet."""
        records = [self.open_record(rollout_id)] if rollout_id is not None else self.records()
        return [c for r in records for c in r.live if c.phase is FINISHED or c.phase is RESPONDED]

    def check_owner(self, rollout_id: str, owner: str | None, now: float) -> None:
        """`RolloutConflict` ``rollout_owned`` unless ``owner`` may act on ``rollout_id``."""
        self.owners.check(validate_rollout_id(rollout_id), owner, now)

    # ---- the events of a rollout -------------------------------------------------------

    def opened(self, rollout_id: str, *, owner: str | None = None, now: float = 0.0) -> None:
        """A rollout was opened (made if new; opening it again changes nothing), held by
        ``owner`` if given; `RolloutConflict` ``rollout_owned`` if another live owner holds
        the id (`Owners.check`)."""
        rid = validate_rollout_id(rollout_id)
        self.owners.check(rid, owner, now)
        self._advance(self.join(rid), "open")
        if self.owners.of(rid) is None:
            self.owners.hold(rid, owner)

    def terminal_declared(
        self,
        rollout_id: str,
        *,
        call_id: str | None = None,
        response_id: str | None = None,
        owner: str | None = None,
        now: float = 0.0,
    ) -> tuple[RolloutRecord, Entry]:
        """The trainer named the rollout's terminal call (by call id or by response id).

        The call must be one the harness was answered with (`InvalidBody`
        ``unknown_terminal`` otherwise, and the rollout is left as it was): a declared
        terminal that names nothing would poison the rollout for good at its receipt.
        """
        if (call_id is None) == (response_id is None):
            raise ValueError("give exactly one of call_id, response_id")
        record = self.open_record(rollout_id)
        self.check_owner(rollout_id, owner, now)
        if call_id is not None:
            event = TerminalDeclared(by="call_id", value=call_id)
        else:
            event = TerminalDeclared(by="response_id", value=response_id or "")
        if not any(
            c.phase in (RESPONDED, COMMITTED, FAILED)
            and (c.call_id == call_id if call_id is not None else c.response_id == response_id)
            for c in record.calls.values()
        ):
            raise InvalidBody(
                "unknown_terminal", f"{rollout_id} has no answered call {event.value!r}"
            )
        return record, self.append(record, event)

    def close_requested(
        self, rollout_id: str, *, owner: str | None = None, now: float = 0.0
    ) -> RolloutRecord:
        """A close of the rollout began: it admits no new call. `close_next` says what the
        close does next, `closed` ends it, `close_failed` takes it back."""
        record = self.open_record(rollout_id)
        self.check_owner(rollout_id, owner, now)
        self._advance(record, "close")
        return record

    def close_next(self, record: RolloutRecord) -> Abandon | Settle | None:
        """What a closing rollout waits for next: every call still in flight is abandoned
        (``closed_in_flight``), then every responded call settles; None: nothing."""
        live = list(record.live)
        for call in live:
            if call.phase is ADMITTED or call.phase is FINISHED:  # in flight
                return Abandon(call)
        for call in live:
            if call.phase is RESPONDED:
                return Settle(call)
        return None

    def closed(
        self, record: RolloutRecord, *, reward: float | None, witnesses: Witnesses | None
    ) -> Entry:
        """The closing rollout's calls are settled: ``Closed``, or ``Poisoned`` with its
        pending poison. `LedgerProtocolError` (a bad reward) changes nothing."""
        if record.poison is not None:
            return self.append(record, Poisoned(reason=record.poison))
        return self.append(record, Closed(reward=reward, witnesses=witnesses or Witnesses()))

    def close_failed(self, record: RolloutRecord) -> None:
        """The close stopped before its entry: the rollout is as it was before it."""
        if record.ledger.status is LEDGER_OPEN:
            self._advance(record, "reopen")

    def released(self, rollout_id: str, *, owner: str | None = None, now: float = 0.0) -> None:
        """Forget a closed rollout; `RolloutConflict` if open (or ``rollout_owned``: another
        live owner holds it), `RolloutNotFound` if unknown."""
        rid = validate_rollout_id(rollout_id)
        self.owners.check(rid, owner, now)
        record = self._open.get(rid)
        if record is not None and record.phase in HELD:
            raise RolloutConflict("rollout_open", f"{rid} is open; close it first")
        if self._closed.pop(rid, None) is None:
            raise RolloutNotFound("unknown_rollout", f"no closed rollout {rid}")
        self.owners.forget(rid)

    def restored(self, ledgers: Iterable[Ledger]) -> list[tuple[RolloutRecord, Entry]]:
        """Stored ledgers came back after a restart: closed ones are served as they were;
        one still open is closed ``Poisoned(gate_restarted)`` (its calls in flight are gone,
        so it is never resumed). Returns those entries, for the observers."""
        poisoned = []
        for ledger in ledgers:
            rid = validate_rollout_id(ledger.rollout_id)
            if ledger.status is not LEDGER_OPEN:
                self._closed[rid] = ledger
                continue
            record = RolloutRecord(rid, ledger, self._lock(), phase=OPEN)
            self._advance(record, "close")
            entry = self.append(record, Poisoned(reason=make_reason(GATE_RESTARTED)))
            poisoned.append((record, entry))
        return poisoned

    def unpersisted(self, record: RolloutRecord, reason: str) -> bool:
        """An entry of the rollout could not be persisted: it is poisoned (``Poisoned`` at its
        close). True if this is its first poison."""
        first = record.poison is None
        self._advance(record, "fail", poison=reason)
        return first

    def call_unserved(self, call: GateCall) -> bool:
        """vLLM refused the call itself (its own 4xx): forget its rollout if it is OPEN,
        unpoisoned, idle and none of its calls was served (every entry ``Admitted`` or
        ``Failed(served=False)``), so requests vLLM refuses leave no rollout behind, like
        those the gate refuses. True if it was forgotten."""
        record = call.rollout
        if (
            record.phase is not OPEN
            or record.poison is not None
            or record.live
            or self._open.get(record.rollout_id) is not record
            or not all(_unserved(entry.event) for entry in record.ledger.entries)
        ):
            return False
        del self._open[record.rollout_id]
        self.owners.forget(record.rollout_id)
        return True


class Owners:
    """The holder of each owned rollout and when each owner last spoke."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.takeovers = 0
        """Rollouts taken over from an owner silent past the lease."""
        self._holder: dict[RolloutId, str] = {}
        self._seen: dict[str, float] = {}

    def of(self, rollout_id: RolloutId) -> str | None:
        """The owner holding ``rollout_id`` (None: anyone's)."""
        return self._holder.get(rollout_id)

    def touch(self, owner: str | None, now: float) -> None:
        """``owner`` spoke at ``now``: its lease runs from here."""
        if owner is not None:
            self._seen[owner] = max(now, self._seen.get(owner, now))

    def check(self, rollout_id: RolloutId, owner: str | None, now: float) -> None:
        """Let ``owner`` act on ``rollout_id``, or raise `RolloutConflict` ``rollout_owned``.

        The holder itself, anyone on an unowned rollout, and anyone once the holder has
        been silent past the lease (the rollout is then ``owner``'s: a takeover) may act.
        """
        holder = self._holder.get(rollout_id)
        if holder is None or holder == owner:
            return
        if now - self._seen.get(holder, now) > self.lease_s:
            self.takeovers += 1
            self.forget(rollout_id)
            self.hold(rollout_id, owner)
            return
        raise RolloutConflict(
            "rollout_owned",
            f"{rollout_id} belongs to another trainer (owner token) that is still active; "
            "use your own rollout ids",
        )

    def hold(self, rollout_id: RolloutId, owner: str | None) -> None:
        """``owner`` holds ``rollout_id`` from now on (None: nobody does)."""
        if owner is not None:
            self._holder[rollout_id] = owner

    def forget(self, rollout_id: RolloutId) -> None:
        """``rollout_id`` is released: nobody holds it."""
        self._holder.pop(rollout_id, None)


def _unserved(event: object) -> bool:
    return isinstance(event, Admitted) or (isinstance(event, Failed) and not event.served)
