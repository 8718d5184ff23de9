"""The custody ledger: a per-rollout, append-only, hash-chained state machine.

Invariants:
- a call moves ADMITTED -> STAGED | FAILED and never leaves a final state;
- a child is admitted only under a STAGED parent, at exactly the parent's cumulative length;
- call ids follow the gate's deterministic sequence (c000001, c000002, ...);
- a staged call's chain hash links to its parent's (so the terminal commits to its path);
- the rollout moves OPEN -> CLOSED (by Closed or Poisoned) and accepts nothing after;
- entry ``i`` hashes ``prev_hash ‖ event``; entry 1 links to the rollout's genesis hash.
An illegal event raises `LedgerProtocolError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from ._digest import LEDGER_DOMAIN, Canon, chain_hash, genesis_hash
from ._errors import LedgerProtocolError, VerificationError
from ._events import Admitted, Closed, Event, Failed, Poisoned, Staged, TerminalDeclared
from .ids import call_id_for, validate_rollout_id
from .states import Sentinel

__all__ = [
    "ADMITTED",
    "CLOSED",
    "FAILED",
    "OPEN",
    "STAGED",
    "CallRecord",
    "CallState",
    "Entry",
    "Ledger",
    "RolloutState",
    "RolloutStatus",
    "apply",
    "entry_hash",
    "initial_state",
    "replay",
]


class CallState(Sentinel):
    """A call's state: `ADMITTED`, `STAGED` or `FAILED` (compare with ``is``)."""


class RolloutStatus(Sentinel):
    """A rollout's status: `OPEN` or `CLOSED` (compare with ``is``)."""


ADMITTED: Final = CallState("ADMITTED")
STAGED: Final = CallState("STAGED")
FAILED: Final = CallState("FAILED")
OPEN: Final = RolloutStatus("OPEN")
CLOSED: Final = RolloutStatus("CLOSED")
_ABSENT: Final = CallState("ABSENT")

_CALL_TABLE: Final[Mapping[CallState, Mapping[type, CallState]]] = {
    _ABSENT: {Admitted: ADMITTED},
    ADMITTED: {Staged: STAGED, Failed: FAILED},
    STAGED: {},
    FAILED: {},
}
_ROLLOUT_TABLE: Final[Mapping[RolloutStatus, Mapping[type, RolloutStatus]]] = {
    OPEN: {
        Admitted: OPEN,
        Staged: OPEN,
        Failed: OPEN,
        TerminalDeclared: OPEN,
        Closed: CLOSED,
        Poisoned: CLOSED,
    },
    CLOSED: {},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRecord:
    """Everything the ledger knows about one call."""

    call_id: str
    state: CallState
    admitted: Admitted
    staged: Staged | None = None
    failed: Failed | None = None

    @property
    def parent_id(self) -> str | None:
        """The parent call id (None for a root)."""
        return self.admitted.parent_id

    @property
    def cum_len(self) -> int:
        """Cumulative token length after this call; only defined once STAGED."""
        if self.staged is None:
            raise LedgerProtocolError(
                "call_not_staged", f"{self.call_id} has no cumulative length yet"
            )
        return self.admitted.prefix_len + self.staged.carry_len + self.staged.gen_len


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One ledger entry: ``hash = H(ledger domain ‖ prev_hash ‖ canonical(event))``."""

    seq: int
    event: Event
    prev_hash: str
    hash: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutState:
    """A rollout's ledger state; derived from its entries, never edited by hand."""

    rollout_id: str
    status: RolloutStatus
    calls: Mapping[str, CallRecord]
    terminal: TerminalDeclared | None
    closed: Closed | None
    poisoned: Poisoned | None
    head_seq: int
    head_hash: str

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last entry; ``(0, genesis)`` for an empty ledger."""
        return self.head_seq, self.head_hash


def entry_hash(prev_hash: str, event: Event) -> str:
    """The hash of an entry holding ``event`` after ``prev_hash`` (a format v3 ``Staged``
    event hashes under its own domain, `Staged.domain`)."""
    domain = event.domain if isinstance(event, Staged) else LEDGER_DOMAIN
    canon = Canon(domain).raw_hash(prev_hash).text(event.KIND)
    event.write(canon)
    return canon.hexdigest()


def initial_state(rollout_id: str) -> RolloutState:
    """The state of a rollout with no entries: OPEN, no calls, head at genesis."""
    validate_rollout_id(rollout_id)
    return RolloutState(
        rollout_id=rollout_id,
        status=OPEN,
        calls=MappingProxyType({}),
        terminal=None,
        closed=None,
        poisoned=None,
        head_seq=0,
        head_hash=genesis_hash(rollout_id),
    )


class _Draft:
    """A mutable working copy: validate an event completely, then mutate."""

    __slots__ = (
        "calls",
        "closed",
        "head_hash",
        "head_seq",
        "poisoned",
        "response_ids",
        "rollout_id",
        "status",
        "terminal",
    )

    def __init__(self, state: RolloutState) -> None:
        self.rollout_id = state.rollout_id
        self.status = state.status
        self.calls: dict[str, CallRecord] = dict(state.calls)
        self.terminal = state.terminal
        self.closed = state.closed
        self.poisoned = state.poisoned
        self.head_seq = state.head_seq
        self.head_hash = state.head_hash
        self.response_ids = {
            rec.staged.response_id: cid
            for cid, rec in self.calls.items()
            if rec.staged and rec.staged.response_id
        }

    def step(self, event: Event, *, known_hash: str | None = None) -> Entry:
        """Apply ``event``; ``known_hash`` is its entry hash when the caller already computed it."""
        next_status = _ROLLOUT_TABLE[self.status].get(type(event))
        if next_status is None:
            if type(event) not in _ROLLOUT_TABLE[OPEN]:
                raise LedgerProtocolError(
                    "unknown_event", f"not a ledger event: {type(event).__name__}"
                )
            raise LedgerProtocolError(
                "rollout_closed", f"{self.rollout_id} is closed; {event.KIND} refused"
            )
        record = self._check(event)
        entry = Entry(
            seq=self.head_seq + 1,
            event=event,
            prev_hash=self.head_hash,
            hash=known_hash or entry_hash(self.head_hash, event),
        )
        # nothing below may raise: the event is legal
        if record is not None:
            self.calls[record.call_id] = record
            if record.staged is not None and record.staged.response_id:
                self.response_ids[record.staged.response_id] = record.call_id
        if isinstance(event, TerminalDeclared):
            self.terminal = event
        elif isinstance(event, Closed):
            self.closed = event
        elif isinstance(event, Poisoned):
            self.poisoned = event
        self.status = next_status
        self.head_seq, self.head_hash = entry.seq, entry.hash
        return entry

    def _check(self, event: Event) -> CallRecord | None:
        """Raise if ``event`` is illegal now; return the call record it would write, if any."""
        if isinstance(event, TerminalDeclared):
            if self.terminal is not None:
                raise LedgerProtocolError(
                    "terminal_already_declared", "a terminal was already declared"
                )
            return None
        if not isinstance(event, (Admitted, Staged, Failed)):
            return None
        current = self.calls.get(event.call_id)
        state = _ABSENT if current is None else current.state
        next_state = _CALL_TABLE[state].get(type(event))
        if next_state is None:
            code = (
                "duplicate_call"
                if isinstance(event, Admitted)
                else ("unknown_call" if current is None else "call_already_final")
            )
            raise LedgerProtocolError(
                code, f"{event.KIND} refused for {event.call_id} in state {state!r}"
            )
        if isinstance(event, Admitted):
            return self._check_admitted(event)
        assert current is not None
        if isinstance(event, Failed):
            return CallRecord(
                call_id=current.call_id, state=FAILED, admitted=current.admitted, failed=event
            )
        return self._check_staged(current, event)

    def _check_admitted(self, event: Admitted) -> CallRecord:
        expected = call_id_for(len(self.calls) + 1)
        if event.call_id != expected:
            raise LedgerProtocolError(
                "call_id_out_of_order", f"expected {expected}, got {event.call_id}"
            )
        if event.parent_id is not None:
            parent = self.calls.get(event.parent_id)
            if parent is None:
                raise LedgerProtocolError(
                    "unknown_parent", f"parent {event.parent_id} was never admitted"
                )
            if parent.state is not STAGED:
                raise LedgerProtocolError(
                    "parent_not_staged", f"parent {event.parent_id} is {parent.state!r}"
                )
            if event.prefix_len != parent.cum_len:
                raise LedgerProtocolError(
                    "prefix_mismatch",
                    f"prefix_len {event.prefix_len} != parent cum_len {parent.cum_len}",
                )
        return CallRecord(call_id=event.call_id, state=ADMITTED, admitted=event)

    def _check_staged(self, current: CallRecord, event: Staged) -> CallRecord:
        parent_chain = None
        if current.parent_id is not None:
            parent_staged = self.calls[current.parent_id].staged
            assert parent_staged is not None  # a child is only admitted under a STAGED parent
            parent_chain = parent_staged.chain_hash
        if event.chain_hash != chain_hash(parent_chain, event.call_digest):
            raise LedgerProtocolError(
                "chain_hash_mismatch", f"{event.call_id}: chain hash does not link to its parent"
            )
        if event.response_id and event.response_id in self.response_ids:
            raise LedgerProtocolError(
                "duplicate_response_id", f"response id reused by {event.call_id}"
            )
        return CallRecord(
            call_id=current.call_id, state=STAGED, admitted=current.admitted, staged=event
        )

    def freeze(self, *, copy: bool) -> RolloutState:
        return RolloutState(
            rollout_id=self.rollout_id,
            status=self.status,
            calls=MappingProxyType(dict(self.calls) if copy else self.calls),
            terminal=self.terminal,
            closed=self.closed,
            poisoned=self.poisoned,
            head_seq=self.head_seq,
            head_hash=self.head_hash,
        )


def apply(state: RolloutState, event: Event) -> RolloutState:
    """The state after ``event``; an illegal one raises `LedgerProtocolError`, changing nothing."""
    draft = _Draft(state)
    draft.step(event)
    return draft.freeze(copy=False)


def replay(rollout_id: str, entries: Iterable[Entry]) -> RolloutState:
    """Re-derive a rollout's state from its entries, checking every seq, link, hash and transition.

    Raises `VerificationError` with code ``bad_seq``, ``broken_link``, ``bad_entry_hash``
    or ``illegal_event:<ledger code>``.
    """
    draft = _Draft(initial_state(rollout_id))
    for entry in entries:
        if entry.seq != draft.head_seq + 1:
            raise VerificationError(
                "bad_seq", f"entry seq {entry.seq} where {draft.head_seq + 1} was due"
            )
        if entry.prev_hash != draft.head_hash:
            raise VerificationError(
                "broken_link", f"entry {entry.seq} does not link to its predecessor"
            )
        computed = entry_hash(entry.prev_hash, entry.event)
        if entry.hash != computed:
            raise VerificationError(
                "bad_entry_hash", f"entry {entry.seq} hash does not match its content"
            )
        try:
            draft.step(entry.event, known_hash=computed)
        except LedgerProtocolError as e:
            raise VerificationError(
                f"illegal_event:{e.code}", f"entry {entry.seq}: {e.message}"
            ) from e
    return draft.freeze(copy=False)


class Ledger:
    """A rollout's ledger for adapters: appends events, keeps entries, serves state, manifests."""

    __slots__ = ("_draft", "_entries", "_snapshot")

    def __init__(self, rollout_id: str) -> None:
        self._draft = _Draft(initial_state(rollout_id))
        self._entries: list[Entry] = []
        self._snapshot: RolloutState | None = None

    @classmethod
    def from_entries(cls, rollout_id: str, entries: Iterable[Entry]) -> Ledger:
        """Rebuild a ledger from stored entries, verifying them (`replay`)."""
        entries = list(entries)
        ledger = cls(rollout_id)
        ledger._draft = _Draft(replay(rollout_id, entries))
        ledger._entries = entries
        return ledger

    @property
    def rollout_id(self) -> str:
        """The rollout this ledger records."""
        return self._draft.rollout_id

    @property
    def state(self) -> RolloutState:
        """The current state (a frozen snapshot)."""
        if self._snapshot is None:
            self._snapshot = self._draft.freeze(copy=True)
        return self._snapshot

    @property
    def status(self) -> RolloutStatus:
        """`OPEN` or `CLOSED` (cheap: no snapshot is taken)."""
        return self._draft.status

    @property
    def entries(self) -> tuple[Entry, ...]:
        """Every entry so far, in order."""
        return tuple(self._entries)

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last entry."""
        return self._draft.head_seq, self._draft.head_hash

    def next_call_id(self) -> str:
        """The call id the next `Admitted` event must carry."""
        return call_id_for(len(self._draft.calls) + 1)

    def append(self, event: Event) -> Entry:
        """Append a legal event and return its entry; `LedgerProtocolError` changes nothing."""
        entry = self._draft.step(event)
        self._entries.append(entry)
        self._snapshot = None
        return entry
