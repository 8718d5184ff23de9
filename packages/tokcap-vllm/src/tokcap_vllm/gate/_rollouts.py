"""The rollouts one gate holds, and the rules that move them and their calls (pure).

No I/O, no engine, no clock, no task group: the driver (`tokcap_vllm.gate._gate.Gate`) tells
the `RolloutBook` what happened and applies what it answers (the flags and locks the
driver waits on are made by factories it passes in). A rollout::

    EMPTY --append--> OPEN --fail--> UNCAPTURED
    EMPTY --open--> OPEN (opened explicitly: held and closable before its first call)
    OPEN --close--> CLOSING --closed--> CLOSED (its ledger kept until released)
    UNCAPTURED --close--> CLOSING_UNCAPTURED --closed--> CLOSED
    CLOSING --fail--> CLOSING_UNCAPTURED
    CLOSING --reopen--> OPEN, CLOSING_UNCAPTURED --reopen--> UNCAPTURED (the close failed)

Its calls move by `tokcap_vllm.gate._lifecycle`'s table; `RolloutBook.step` applies each call
step's effects (`EFFECTS`: claims, the live set, the parent index, the rollout's phase).

Invariants:
- a rollout id names at most one open record; an EMPTY record (no entry) is forgotten
  when its last live call is dropped, so a refused request leaves nothing behind; a
  CLOSED rollout keeps only its ledger until released; calls hold their record, never
  its id, so a call of a released rollout can never reach a record reusing the id;
- the number of open records is bounded (``max_open``);
- an UNCAPTURED rollout (a call of it failed) refuses its later calls
  (``rollout_poisoned``); an OPEN rollout none of whose calls was served is forgotten
  when vLLM refuses a call of it (`forget_unserved`); a pending *poison* (a failure
  outside any one call's entries) makes its close ``Poisoned`` instead of ``Closed``;
- a call holds its idempotency key and request id from its claim until it is dropped or
  abandoned; it is *live* until final or contained; it is a parent (in the rollout's
  `ParentIndex`) from ``respond`` until ``fail``;
- a step either applies in full, with its effects, or raises `CallStateError` and
  changes nothing. Entries are appended by the driver (`Gate._append`), which also
  tells its observers and then `advance`-s the rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

from tokcap_core import Ledger
from tokcap_core.ids import RolloutId, validate_rollout_id
from tokcap_core.ledger import OPEN as LEDGER_OPEN
from tokcap_core.ledger import Admitted, Failed

from ..errors import RolloutConflict, RolloutNotFound, TooManyRollouts
from ._lifecycle import EFFECTS, REFUSALS, TRANSITIONS, CallPhase, next_phase
from ._owners import Owners
from ._records import (
    CLOSED,
    CLOSING,
    CLOSING_UNCAPTURED,
    EMPTY,
    IN_CLOSE,
    OPEN,
    UNCAPTURED,
    Flag,
    GateCall,
    RolloutPhase,
    RolloutRecord,
    answerable,
    gone,
)

__all__ = [
    "CLOSED",
    "CLOSING",
    "CLOSING_UNCAPTURED",
    "EMPTY",
    "OPEN",
    "UNCAPTURED",
    "RolloutBook",
    "RolloutPhase",
    "RolloutRecord",
    "check_not_poisoned",
]


_TRANSITIONS: Final[Mapping[RolloutPhase, Mapping[str, RolloutPhase]]] = {
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
_REFUSALS: Final[Mapping[RolloutPhase, Mapping[str, str]]] = {
    EMPTY: dict.fromkeys(("close", "closed", "reopen"), "not_open"),
    OPEN: dict.fromkeys(("closed", "reopen"), "not_closing"),
    UNCAPTURED: dict.fromkeys(("closed", "reopen"), "not_closing"),
    CLOSING: dict.fromkeys(("close", "open"), "rollout_closed"),
    CLOSING_UNCAPTURED: dict.fromkeys(("close", "open"), "rollout_closed"),
    CLOSED: dict.fromkeys(("append", "close", "closed", "reopen", "open"), "rollout_closed"),
}


class RolloutBook:
    """Every rollout one gate holds, open and closed, and the rules of their calls."""

    def __init__(
        self,
        *,
        max_open: int,
        flag: Callable[[], Flag],
        lock: Callable[[], AbstractAsyncContextManager[Any]],
        owner_lease_s: float = 600.0,
    ) -> None:
        self.max_open = max_open
        self.owners = Owners(owner_lease_s)
        """Who holds each owned rollout (`tokcap_vllm.gate._owners`)."""
        self._flag = flag
        self._lock = lock
        self._open: dict[RolloutId, RolloutRecord] = {}
        self._closed: dict[RolloutId, Ledger] = {}

    # ---- rollouts ----------------------------------------------------------------------

    def join(self, rollout_id: str, *, require_open: bool = False) -> RolloutRecord:
        """The open record a new request joins, made on first use.

        `RolloutConflict` (409) if the id names a closed (or closing) rollout;
        `TooManyRollouts` (503) when ``max_open`` records are open already; with
        ``require_open``, `RolloutNotFound` (``unknown_rollout``) unless it was opened.
        """
        rid = validate_rollout_id(rollout_id)
        if rid in self._closed:
            raise RolloutConflict("rollout_closed", f"{rid} is closed; start a new rollout id")
        record = self._open.get(rid)
        if require_open and (record is None or record.phase is EMPTY):
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
            record = self._open[rid] = RolloutRecord(rid, Ledger(rid), self._lock())
        elif record.phase in IN_CLOSE:
            raise RolloutConflict("rollout_closed", f"{rid} is closing")
        return record

    def open(self, rollout_id: str, *, owner: str | None = None, now: float = 0.0) -> RolloutRecord:
        """Open a rollout explicitly (made if new; opening it again changes nothing), held
        by ``owner`` if given; `RolloutConflict` ``rollout_owned`` if another live owner
        holds the id (`Owners.check`)."""
        rid = validate_rollout_id(rollout_id)
        self.owners.check(rid, owner, now)
        record = self.join(rid)
        self.advance(record, "open")
        if self.owners.of(rid) is None:
            self.owners.hold(rid, owner)
        return record

    def check_owner(self, rollout_id: str, owner: str | None, now: float) -> None:
        """`RolloutConflict` ``rollout_owned`` unless ``owner`` may act on ``rollout_id``."""
        self.owners.check(validate_rollout_id(rollout_id), owner, now)

    def open_record(self, rollout_id: str) -> RolloutRecord:
        """The open record of ``rollout_id``: `RolloutNotFound` / `RolloutConflict` if not open."""
        rid = validate_rollout_id(rollout_id)
        record = self._open.get(rid)
        if record is None or not record.held:
            if rid in self._closed:
                raise RolloutConflict("rollout_closed", f"{rid} is closed")
            raise RolloutNotFound("unknown_rollout", f"no open rollout {rid}")
        if record.phase in IN_CLOSE:
            raise RolloutConflict("rollout_closed", f"{rid} is closing")
        return record

    def ledger(self, rollout_id: str) -> Ledger:
        """The ledger of an open or closed rollout; `RolloutNotFound` otherwise."""
        rid = validate_rollout_id(rollout_id)
        record = self._open.get(rid)
        if record is not None and record.held:
            return record.ledger
        if rid in self._closed:
            return self._closed[rid]
        raise RolloutNotFound("unknown_rollout", f"no rollout {rid}")

    def holders(self) -> dict[RolloutId, str]:
        """``{rollout_id: owner}`` of every owned rollout held."""
        return {rid: o for rid in self.states() if (o := self.owners.of(rid)) is not None}

    def states(self) -> dict[RolloutId, str]:
        """Every rollout held, ``{rollout_id: "open" | "closed"}``."""
        held = dict.fromkeys(self._closed, "closed")
        held.update({rid: "open" for rid, r in self._open.items() if r.held})
        return held

    def counts(self) -> tuple[int, int]:
        """``(open, closed)`` rollouts held."""
        return sum(1 for r in self._open.values() if r.held), len(self._closed)

    def records(self) -> list[RolloutRecord]:
        """Every open record."""
        return list(self._open.values())

    def held_ledgers(self) -> list[Ledger]:
        """Every ledger held, open and closed (what a ledger-file compaction keeps)."""
        return [*self._closed.values(), *(r.ledger for r in self._open.values())]

    def advance(self, record: RolloutRecord, op: str, *, poison: str | None = None) -> None:
        """Apply a rollout step (``poison`` with ``fail``: a pending ``Poisoned``)."""
        nxt = next_phase(record.phase, op, _TRANSITIONS, _REFUSALS)
        record.phase = nxt
        if poison is not None and record.poison is None:
            record.poison = poison
        if nxt is CLOSED:
            if self._open.get(record.rollout_id) is record:
                del self._open[record.rollout_id]
            self._closed[record.rollout_id] = record.ledger

    def release(self, rollout_id: str, *, owner: str | None = None, now: float = 0.0) -> None:
        """Forget a closed rollout; `RolloutConflict` if open (or ``rollout_owned``: another
        live owner holds it), `RolloutNotFound` if unknown."""
        rid = validate_rollout_id(rollout_id)
        self.owners.check(rid, owner, now)
        record = self._open.get(rid)
        if record is not None and record.held:
            raise RolloutConflict("rollout_open", f"{rid} is open; close it first")
        if self._closed.pop(rid, None) is None:
            raise RolloutNotFound("unknown_rollout", f"no closed rollout {rid}")
        self.owners.forget(rid)

    def adopt(self, ledgers: Iterable[Ledger]) -> list[RolloutRecord]:
        """Take back stored ledgers after a restart: closed ones are served as they were.

        Returns OPEN records (not held by the book) for the ledgers that were still open,
        for the driver to poison and close: their in-flight calls are gone.
        """
        reopened = []
        for ledger in ledgers:
            rid = validate_rollout_id(ledger.rollout_id)
            if ledger.status is LEDGER_OPEN:
                reopened.append(RolloutRecord(rid, ledger, self._lock(), phase=OPEN))
            else:
                self._closed[rid] = ledger
        return reopened

    # ---- calls -------------------------------------------------------------------------

    def begin(
        self,
        record: RolloutRecord,
        *,
        kind: str,
        idempotency_key: str | None = None,
        body_fingerprint: str = "",
        request_id: str | None = None,
    ) -> GateCall:
        """A new live call of ``record``; `RolloutConflict` (``rollout_poisoned``) when the
        rollout already failed."""
        check_not_poisoned(record)
        call = GateCall(
            record,
            kind,
            self._flag(),
            self._flag(),
            idempotency_key=idempotency_key,
            body_fingerprint=body_fingerprint,
            request_id=request_id,
            abandoned=self._flag(),
        )
        record.live.add(call)
        return call

    def claim(self, call: GateCall) -> GateCall | None:
        """Hold ``call``'s key and request id; or the call to wait for, or to answer again.

        Returns None once held; else the holder of the key: the driver sends its recorded
        answer again if it settled with one (`answerable`), or waits for it to settle and
        asks again.
        """
        record = call.rollout
        key = call.idempotency_key
        holder = record.keys.get(key) if key is not None else None
        if holder is not None and holder is not call and not gone(holder):
            if holder.body_fingerprint != call.body_fingerprint:
                raise RolloutConflict(
                    "idempotency_key_reused",
                    "this Idempotency-Key was used with a different request body",
                )
            if not holder.final or answerable(holder):
                return holder
        if key is not None:
            record.keys[key] = call
        if call.request_id is not None:
            other = record.request_ids.get(call.request_id)
            if other is not None and other is not call:
                raise RolloutConflict(
                    "duplicate_request_id",
                    f"request id {call.request_id!r} was already used in this rollout",
                )
            record.request_ids[call.request_id] = call
        return None

    def step(self, call: GateCall, op: str) -> CallPhase:
        """Apply ``op`` to ``call``, with the effects its table names on the rollout."""
        was = call.phase
        nxt: CallPhase = next_phase(was, op, TRANSITIONS, REFUSALS)
        if nxt is was:
            return nxt  # the engine or the response went on after an abandon: ignored
        call.phase = nxt
        for effect in EFFECTS[op]:
            self._apply(effect, call.rollout, call)
        if call.final:
            call.settled.set()
        return nxt

    def _apply(self, effect: str, record: RolloutRecord, call: GateCall) -> None:
        if effect == "leave":
            record.live.discard(call)
        elif effect == "release_claims":
            key, rid = call.idempotency_key, call.request_id
            if key is not None and record.keys.get(key) is call:
                del record.keys[key]
            if rid is not None and record.request_ids.get(rid) is call:
                del record.request_ids[rid]
        elif effect == "forget_if_idle":
            if (
                record.phase is EMPTY
                and not record.live
                and self._open.get(record.rollout_id) is record
            ):
                del self._open[record.rollout_id]
        elif effect == "index_call":
            assert call.call_id is not None
            record.calls[call.call_id] = call
        elif effect == "index_parent":
            if call.prior is not None and call.plan is not None:
                record.parents.add(call.prior, len(call.plan.prompt_text))
        elif effect == "unindex_parent":
            if call.prior is not None:
                record.parents.forget(call.prior)
        elif effect == "uncapture":
            self.advance(record, "fail")
        elif effect == "signal_abandoned" and call.abandoned is not None:
            call.abandoned.set()

    def forget_unserved(self, record: RolloutRecord) -> bool:
        """Forget an OPEN record none of whose calls was served (every entry ``Admitted`` or
        ``Failed(served=False)``) and that has no live call; True if it was forgotten."""
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

    def contain(self, call: GateCall, reason: str) -> None:
        """A call failed inside the gate: its rollout is poisoned and the call leaves."""
        self.advance(call.rollout, "fail", poison=reason)
        call.rollout.live.discard(call)
        call.sink_done.set()
        call.settled.set()


def check_not_poisoned(record: RolloutRecord) -> None:
    """`RolloutConflict` (``rollout_poisoned``) if a call of ``record`` failed: a captured
    path never answers a call its ledger would not hold."""
    if record.phase is UNCAPTURED:
        raise RolloutConflict(
            "rollout_poisoned",
            f"{record.rollout_id} failed ({record.poison or 'a call failed'}) and cannot "
            "verify; its calls are refused: close it and start a new rollout",
        )


def _unserved(event: object) -> bool:
    return isinstance(event, Admitted) or (isinstance(event, Failed) and not event.served)
