"""Group slots: a trainer's buffer of GRPO groups in capture mode, as a pure state machine.

h11-style (`GroupSlots` is the one mutable object):

    (absent) --reserve--> RESERVED --commit_finalized--> READY --remove--> (absent)
                          RESERVED --abort--> (absent)

Invariants:
- Slots are keyed by group id, never by position; a rollout id lives in at most one slot.
- A sink key enters custody as an argument (``commit_finalized``/``abort``) and leaves in
  exactly one :class:`ClearPlan`; the caller clears exactly the keys a plan hands it.
  Staging keys leave at once (reassembled rows make them garbage); training keys are held
  until ``remove``. Keys held by live slots are unique.
- Every method either applies fully or raises :class:`SlotError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, TypeVar

from ._errors import SlotError
from ._renamed import renamed_names
from .ids import StagingKey, TrainingKey
from .states import Sentinel

__all__ = ["READY", "RESERVED", "ClearPlan", "GroupSlots", "Slot", "SlotState"]


class SlotState(Sentinel):
    """A slot state sentinel; compare with ``is``. Pickles back to the same object."""


RESERVED: Final = SlotState("RESERVED")
READY: Final = SlotState("READY")
_ABSENT: Final = SlotState("_ABSENT")  # no slot for the group id; never stored

# Legal transitions, and the error code for every illegal (state, op) pair.
_TRANSITIONS: Final[dict[SlotState, dict[str, SlotState]]] = {
    _ABSENT: {"reserve": RESERVED},
    RESERVED: {"commit_finalized": READY, "abort": _ABSENT},
    READY: {"remove": _ABSENT},
}
_REFUSALS: Final[dict[SlotState, dict[str, str]]] = {
    _ABSENT: {
        "commit_finalized": "unknown_group",
        "abort": "unknown_group",
        "remove": "unknown_group",
    },
    RESERVED: {"reserve": "duplicate_group", "remove": "not_ready"},
    READY: {
        "reserve": "duplicate_group",
        "commit_finalized": "already_committed",
        "abort": "not_reserved",
    },
}


_Key = TypeVar("_Key", bound=str)


def _check_keys(keys: Sequence[_Key], what: str) -> tuple[_Key, ...]:
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise SlotError("bad_argument", f"{what} must be a sequence of non-empty str")
    out = tuple(keys)
    if len(set(out)) != len(out):
        raise SlotError("duplicate_key", f"{what} lists a key twice")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ClearPlan:
    """Sink keys the caller now owns and must clear, each handed out exactly once."""

    training_keys: tuple[TrainingKey, ...] = ()
    staging_keys: tuple[StagingKey, ...] = ()

    def __post_init__(self) -> None:
        _check_keys(self.training_keys, "training_keys")
        _check_keys(self.staging_keys, "staging_keys")


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """One group's slot: its rollouts, target step and, once READY, its training keys."""

    group_id: str
    rollout_ids: tuple[str, ...]
    weight_version: int
    target_step: int
    state: SlotState
    training_keys: tuple[TrainingKey, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, str) or not self.group_id:
            raise SlotError("bad_argument", "group_id must be a non-empty str")
        if not self.rollout_ids:
            raise SlotError("empty_group", f"group {self.group_id!r} has no rollouts")
        if not all(isinstance(r, str) and r for r in self.rollout_ids):
            raise SlotError("bad_argument", "rollout_ids must be non-empty str")
        if len(set(self.rollout_ids)) != len(self.rollout_ids):
            raise SlotError("duplicate_rollout", f"group {self.group_id!r} repeats a rollout")
        for name in ("weight_version", "target_step"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise SlotError("bad_argument", f"{name} must be an int >= 0: {value!r}")
        if self.state is not RESERVED and self.state is not READY:
            raise SlotError("bad_argument", f"a stored slot is RESERVED or READY: {self.state}")
        _check_keys(self.training_keys, "training_keys")
        if self.state is RESERVED and self.training_keys:
            raise SlotError("bad_argument", "a RESERVED slot holds no training keys")


class GroupSlots:
    """The live slots of one trainer's buffer, by group id (the one mutable object here)."""

    __slots__ = ("_held_training", "_owner", "_ready", "_slots")

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self._ready: dict[str, None] = {}  # READY group ids in commit order
        self._owner: dict[str, str] = {}  # rollout id -> group id, for live slots
        self._held_training: set[str] = set()

    def _state(self, group_id: str) -> SlotState:
        slot = self._slots.get(group_id)
        return _ABSENT if slot is None else slot.state

    def _step(self, group_id: str, op: str) -> SlotState:
        state = self._state(group_id)
        next_state = _TRANSITIONS[state].get(op)
        if next_state is None:
            raise SlotError(_REFUSALS[state][op], f"{op} of {group_id!r} in state {state}")
        return next_state

    def _staging_keys(
        self, slot: Slot, staging_keys: Sequence[StagingKey]
    ) -> tuple[StagingKey, ...]:
        keys = _check_keys(staging_keys, "staging_keys")
        for key in keys:
            if key.partition("/")[0] not in slot.rollout_ids:
                raise SlotError(
                    "foreign_key", f"staging key {key!r} is not a rollout of {slot.group_id!r}"
                )
        return keys

    def reserve(
        self, group_id: str, rollout_ids: Sequence[str], weight_version: int, target_step: int
    ) -> Slot:
        """Open a RESERVED slot for a group about to be reassembled."""
        self._step(group_id, "reserve")
        if isinstance(rollout_ids, str):
            raise SlotError("bad_argument", "rollout_ids must be a sequence of str")
        slot = Slot(
            group_id=group_id,
            rollout_ids=tuple(rollout_ids),
            weight_version=weight_version,
            target_step=target_step,
            state=RESERVED,
        )
        taken = [r for r in slot.rollout_ids if r in self._owner]
        if taken:
            raise SlotError(
                "duplicate_rollout", f"{taken[0]!r} is already in group {self._owner[taken[0]]!r}"
            )
        self._slots[group_id] = slot
        self._owner.update(dict.fromkeys(slot.rollout_ids, group_id))
        return slot

    def commit_finalized(
        self,
        group_id: str,
        *,
        training_keys: Sequence[TrainingKey],
        staging_keys: Sequence[StagingKey],
    ) -> ClearPlan:
        """RESERVED → READY once the group's training rows are published.

        The slot holds ``training_keys`` until :meth:`remove`. ``staging_keys`` are the
        staged rows the reassembly consumed and did *not* clear itself; the returned plan
        hands them to the caller to clear now. A reassembler that clears staging itself
        reports none. Keys must be unique, staging keys ``"{rollout_id}/…"`` of this group.
        """
        self._step(group_id, "commit_finalized")
        slot = self._slots[group_id]
        training = _check_keys(training_keys, "training_keys")
        staging = self._staging_keys(slot, staging_keys)
        clash = self._held_training.intersection(training) or set(training).intersection(staging)
        if clash:
            raise SlotError("duplicate_key", f"key {min(clash)!r} is already held")
        self._slots[group_id] = replace(slot, state=READY, training_keys=training)
        self._ready[group_id] = None
        self._held_training.update(training)
        return ClearPlan(staging_keys=staging)

    def abort(self, group_id: str, *, staging_keys: Sequence[StagingKey]) -> ClearPlan:
        """Drop a RESERVED slot (reassembly failed or was abandoned).

        Returns the group's still-staged rows for the caller to clear.
        """
        self._step(group_id, "abort")
        slot = self._slots[group_id]
        staging = self._staging_keys(slot, staging_keys)
        del self._slots[group_id]
        for rollout_id in slot.rollout_ids:
            del self._owner[rollout_id]
        return ClearPlan(staging_keys=staging)

    def remove(self, group_ids: Iterable[str]) -> ClearPlan:
        """Remove READY groups (consumed by training), all or none.

        Returns their training keys, in the order given. Staging keys were already handed
        out at commit, so the plan's ``staging_keys`` is empty.
        """
        ids = tuple(group_ids)
        if len(set(ids)) != len(ids):
            raise SlotError("duplicate_group", "remove lists a group twice")
        for group_id in ids:
            self._step(group_id, "remove")
        slots = [self._slots.pop(group_id) for group_id in ids]
        training = tuple(key for slot in slots for key in slot.training_keys)
        for slot in slots:
            del self._ready[slot.group_id]
            for rollout_id in slot.rollout_ids:
                del self._owner[rollout_id]
        self._held_training.difference_update(training)
        return ClearPlan(training_keys=training)

    def ready(self) -> tuple[str, ...]:
        """READY group ids, in commit order."""
        return tuple(self._ready)

    def slot(self, group_id: str) -> Slot:
        """The live slot of ``group_id``; ``unknown_group`` if there is none."""
        slot = self._slots.get(group_id)
        if slot is None:
            raise SlotError("unknown_group", f"no slot for group {group_id!r}")
        return slot

    def stale(self, current_step: int, max_age: int) -> tuple[str, ...]:
        """Live group ids (either state) with ``current_step - target_step > max_age``.

        For sweeping abandoned groups: abort the RESERVED ones, remove the READY ones.
        """
        if max_age < 0:
            raise SlotError("bad_argument", f"max_age must be >= 0: {max_age}")
        return tuple(g for g, s in self._slots.items() if current_step - s.target_step > max_age)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupSlots):
            return NotImplemented
        return self._slots == other._slots and list(self._ready) == list(other._ready)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GroupSlots({len(self._slots)} slots, {len(self._ready)} ready)"


__getattr__ = renamed_names(__name__, {"ReplaySlots": GroupSlots})
"""``ReplaySlots`` was renamed `GroupSlots` ("replay" names the ledger's replay alone)."""
