"""Group slots: every (state, op) pair, key custody, and a stateful model check."""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokcap_core.errors import SlotError
from tokcap_core.slots import READY, RESERVED, ClearPlan, GroupSlots, Slot

Op = Callable[[GroupSlots], object]

OPS: dict[str, Op] = {
    "reserve": lambda s: s.reserve("g", ["r9"], 0, 0),
    "commit_finalized": lambda s: s.commit_finalized(
        "g", training_keys=["t/g/1"], staging_keys=["r1/c1"]
    ),
    "abort": lambda s: s.abort("g", staging_keys=["r1/c1"]),
    "remove": lambda s: s.remove(["g"]),
}


def in_state(state: str) -> GroupSlots:
    slots = GroupSlots()
    slots.reserve("other", ["r0"], 0, 0)  # a bystander that must never be touched
    if state in ("RESERVED", "READY"):
        slots.reserve("g", ["r1", "r2"], 3, 7)
    if state == "READY":
        slots.commit_finalized("g", training_keys=["t/g/0"], staging_keys=["r1/c0"])
    return slots


# (state, op) -> next state, or the error code of the refusal. Every pair is listed.
TABLE: dict[tuple[str, str], str] = {
    ("ABSENT", "reserve"): "RESERVED",
    ("ABSENT", "commit_finalized"): "unknown_group",
    ("ABSENT", "abort"): "unknown_group",
    ("ABSENT", "remove"): "unknown_group",
    ("RESERVED", "reserve"): "duplicate_group",
    ("RESERVED", "commit_finalized"): "READY",
    ("RESERVED", "abort"): "ABSENT",
    ("RESERVED", "remove"): "not_ready",
    ("READY", "reserve"): "duplicate_group",
    ("READY", "commit_finalized"): "already_committed",
    ("READY", "abort"): "not_reserved",
    ("READY", "remove"): "ABSENT",
}


def test_table_covers_every_pair() -> None:
    assert set(TABLE) == {(s, o) for s in ("ABSENT", "RESERVED", "READY") for o in OPS}


@pytest.mark.parametrize(("state", "op"), sorted(TABLE))
def test_every_state_op_pair(state: str, op: str) -> None:
    slots = in_state(state)
    before = copy.deepcopy(slots)
    outcome = TABLE[state, op]
    if outcome in ("ABSENT", "RESERVED", "READY"):
        OPS[op](slots)
        after = repr(slots.slot("g").state) if "g" in slots else "ABSENT"
        assert after == outcome
        assert slots.slot("other") == before.slot("other")
    else:
        with pytest.raises(SlotError) as info:
            OPS[op](slots)
        assert info.value.code == outcome
        assert slots == before


def test_keys_change_hands_once() -> None:
    slots = GroupSlots()
    slot = slots.reserve("g1", ("a", "b"), weight_version=2, target_step=5)
    assert (slot.state, slot.rollout_ids, slot.training_keys) == (RESERVED, ("a", "b"), ())
    plan = slots.commit_finalized("g1", training_keys=["t/0", "t/1"], staging_keys=["a/c1", "b/c1"])
    assert plan == ClearPlan(staging_keys=("a/c1", "b/c1"))  # staging is the caller's now
    assert slots.slot("g1").state is READY
    slots.reserve("g2", ["c"], 2, 6)
    assert slots.abort("g2", staging_keys=["c/c1"]) == ClearPlan(staging_keys=("c/c1",))
    assert slots.remove(["g1"]) == ClearPlan(training_keys=("t/0", "t/1"))
    assert len(slots) == 0


def test_ready_is_in_commit_order_and_remove_is_by_id() -> None:
    slots = GroupSlots()
    for g in ("g1", "g2", "g3"):
        slots.reserve(g, [f"{g}r"], 0, 0)
    for g in ("g3", "g1", "g2"):
        slots.commit_finalized(g, training_keys=[f"t/{g}"], staging_keys=[])
    assert slots.ready() == ("g3", "g1", "g2")
    assert slots.remove(["g1"]).training_keys == ("t/g1",)
    assert slots.ready() == ("g3", "g2")
    with pytest.raises(SlotError, match="unknown_group"):  # a racing second remove
        slots.remove(["g1"])


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda s: s.reserve("n", [], 0, 0), "empty_group"),
        (lambda s: s.reserve("n", ["x", "x"], 0, 0), "duplicate_rollout"),
        (lambda s: s.reserve("n", ["r1"], 0, 0), "duplicate_rollout"),  # live in "g"
        (lambda s: s.reserve("n", "xy", 0, 0), "bad_argument"),
        (lambda s: s.reserve("", ["x"], 0, 0), "bad_argument"),
        (lambda s: s.reserve("n", ["x"], -1, 0), "bad_argument"),
        (lambda s: s.reserve("n", ["x"], 0, True), "bad_argument"),
        (
            lambda s: s.commit_finalized("g", training_keys=["t", "t"], staging_keys=[]),
            "duplicate_key",
        ),
        (
            lambda s: s.commit_finalized("g", training_keys=["t/h/0"], staging_keys=[]),
            "duplicate_key",
        ),  # held by READY group "h"
        (
            lambda s: s.commit_finalized("g", training_keys=["r1/c"], staging_keys=["r1/c"]),
            "duplicate_key",
        ),
        (
            lambda s: s.commit_finalized("g", training_keys=[], staging_keys=["r0/c1"]),
            "foreign_key",
        ),
        (lambda s: s.commit_finalized("g", training_keys=[""], staging_keys=[]), "bad_argument"),
        (lambda s: s.commit_finalized("g", training_keys="t", staging_keys=[]), "bad_argument"),
        (lambda s: s.abort("g", staging_keys=["zz/c1"]), "foreign_key"),
        (lambda s: s.remove(["h", "h"]), "duplicate_group"),
        (lambda s: s.remove(["h", "nope"]), "unknown_group"),
        (lambda s: s.remove(["h", "g"]), "not_ready"),
        (lambda s: s.stale(0, -1), "bad_argument"),
        (lambda s: s.slot("nope"), "unknown_group"),
    ],
)
def test_bad_calls_raise_and_change_nothing(call: Op, code: str) -> None:
    slots = GroupSlots()
    slots.reserve("h", ["r0"], 0, 0)
    slots.commit_finalized("h", training_keys=["t/h/0"], staging_keys=[])
    slots.reserve("g", ["r1", "r2"], 0, 0)
    before = copy.deepcopy(slots)
    with pytest.raises(SlotError) as info:
        call(slots)
    assert info.value.code == code
    assert slots == before


def test_stale_finds_old_groups_in_any_state() -> None:
    slots = GroupSlots()
    slots.reserve("old", ["a"], 0, target_step=1)
    slots.reserve("done", ["b"], 0, target_step=2)
    slots.commit_finalized("done", training_keys=["t"], staging_keys=[])
    slots.reserve("new", ["c"], 0, target_step=9)
    assert slots.stale(10, max_age=7) == ("old", "done")
    assert slots.stale(10, max_age=8) == ("old",)
    assert slots.stale(10, max_age=9) == ()


def test_values_are_frozen_and_sentinels_pickle_to_themselves() -> None:
    assert pickle.loads(pickle.dumps(READY)) is READY
    assert repr(RESERVED) == "RESERVED"
    slot = Slot(group_id="g", rollout_ids=("a",), weight_version=0, target_step=0, state=READY)
    assert pickle.loads(pickle.dumps(slot)) == slot
    with pytest.raises(SlotError, match="bad_argument"):
        Slot(
            group_id="g",
            rollout_ids=("a",),
            weight_version=0,
            target_step=0,
            state=RESERVED,
            training_keys=("t",),
        )
    with pytest.raises(AttributeError):
        slot.state = RESERVED  # type: ignore[misc]
    err = pickle.loads(pickle.dumps(SlotError("not_ready", "m")))
    assert (err.code, err.message) == ("not_ready", "m")


ROLLOUTS = [f"r{i}" for i in range(6)]
GROUPS = [f"g{i}" for i in range(5)]


class SlotsModel(RuleBasedStateMachine):
    """Random reserve/commit/abort/remove against a dict model; keys clear exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.slots = GroupSlots()
        self.model: dict[str, tuple[str, tuple[str, ...]]] = {}  # group -> (state, rollouts)
        self.order: list[str] = []  # READY groups in commit order
        self.introduced: set[str] = set()
        self.cleared: list[str] = []
        self.minted = 0

    def mint(self, prefix: str) -> str:
        self.minted += 1
        return f"{prefix}/k{self.minted}"

    def take(self, plan: ClearPlan) -> None:
        self.cleared.extend(plan.training_keys + plan.staging_keys)

    def refused(self, call: Callable[[], object], code: str) -> None:
        before = copy.deepcopy(self.slots)
        with pytest.raises(SlotError) as info:
            call()
        assert info.value.code == code
        assert self.slots == before

    def state_of(self, group: str) -> str:
        return self.model[group][0] if group in self.model else "ABSENT"

    @rule(group=st.sampled_from(GROUPS), rollouts=st.sets(st.sampled_from(ROLLOUTS), max_size=3))
    def reserve(self, group: str, rollouts: set[str]) -> None:
        ids = sorted(rollouts)
        live = {r for _, rs in self.model.values() for r in rs}
        code = TABLE[self.state_of(group), "reserve"]
        if code == "RESERVED" and not ids:
            code = "empty_group"
        elif code == "RESERVED" and live.intersection(ids):
            code = "duplicate_rollout"
        if code != "RESERVED":
            self.refused(lambda: self.slots.reserve(group, ids, 0, 0), code)
            return
        self.slots.reserve(group, ids, 0, 0)
        self.model[group] = ("RESERVED", tuple(ids))

    def staged(self, group: str, data: st.DataObject) -> list[str]:
        rollouts = self.model[group][1] if group in self.model else ("zz",)
        picks = data.draw(st.lists(st.sampled_from(rollouts), max_size=3))
        return [self.mint(r) for r in picks]

    @rule(group=st.sampled_from(GROUPS), n_training=st.integers(0, 3), data=st.data())
    def commit(self, group: str, n_training: int, data: st.DataObject) -> None:
        training = [self.mint("train") for _ in range(n_training)]
        staging = self.staged(group, data)
        code = TABLE[self.state_of(group), "commit_finalized"]

        def call() -> ClearPlan:
            return self.slots.commit_finalized(group, training_keys=training, staging_keys=staging)

        if code != "READY":
            self.refused(call, code)
            return
        plan = call()
        assert plan.staging_keys == tuple(staging)
        assert plan.training_keys == ()
        self.introduced.update(training + staging)
        self.take(plan)
        self.model[group] = ("READY", self.model[group][1])
        self.order.append(group)

    @rule(group=st.sampled_from(GROUPS), data=st.data())
    def abort(self, group: str, data: st.DataObject) -> None:
        staging = self.staged(group, data)
        code = TABLE[self.state_of(group), "abort"]
        if code != "ABSENT":
            self.refused(lambda: self.slots.abort(group, staging_keys=staging), code)
            return
        self.introduced.update(staging)
        self.take(self.slots.abort(group, staging_keys=staging))
        del self.model[group]

    @rule(groups=st.lists(st.sampled_from(GROUPS), max_size=3))
    def remove(self, groups: list[str]) -> None:
        codes = [TABLE[self.state_of(g), "remove"] for g in groups]
        bad = [c for c in codes if c != "ABSENT"]
        if len(set(groups)) != len(groups) or bad:
            code = "duplicate_group" if len(set(groups)) != len(groups) else bad[0]
            self.refused(lambda: self.slots.remove(groups), code)
            return
        self.take(self.slots.remove(groups))
        for g in groups:
            del self.model[g]
            self.order.remove(g)

    @invariant()
    def matches_model(self) -> None:
        assert len(self.slots) == len(self.model)
        assert self.slots.ready() == tuple(self.order)
        for group, (state, rollouts) in self.model.items():
            slot = self.slots.slot(group)
            assert repr(slot.state) == state
            assert slot.rollout_ids == rollouts
        assert len(self.cleared) == len(set(self.cleared))

    def teardown(self) -> None:
        for group, (state, rollouts) in list(self.model.items()):
            if state == "RESERVED":
                staging = [self.mint(r) for r in rollouts]
                self.introduced.update(staging)
                self.take(self.slots.abort(group, staging_keys=staging))
        self.take(self.slots.remove(list(self.order)))
        assert len(self.slots) == 0
        assert not [k for k, n in Counter(self.cleared).items() if n > 1]  # none cleared twice
        assert set(self.cleared) == self.introduced


TestSlotsModel = SlotsModel.TestCase


def test_the_old_replay_names_still_resolve_with_a_deprecation_warning() -> None:
    """``replay`` now names the ledger's replay alone; the slots' old names stay as aliases."""
    import tokcap_core.errors
    import tokcap_core.slots

    with pytest.warns(DeprecationWarning, match="use GroupSlots"):
        assert tokcap_core.slots.ReplaySlots is GroupSlots  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="use SlotError"):
        assert tokcap_core.errors.ReplaySlotError is SlotError  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        tokcap_core.slots.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
