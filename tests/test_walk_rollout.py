"""The walk's measuring core (``bench/walk_rollout.py``), engine-free: what counts as holding
the rollout id, what a stay and a return are, and which frames each figure takes.

The walk itself, on a real gate, is ``tests/vllm/test_walk.py``.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any

import pytest

from tests.benches import load_bench
from tokcap_core import Ledger
from tokcap_vllm import RolloutClose


@pytest.fixture(scope="module")
def walk() -> ModuleType:
    """``bench/walk_rollout.py`` (benches are scripts: loaded by path)."""
    return load_bench("walk_rollout")


class _Foreign:
    """Not a tokcap class: its ``rollout_id`` attribute is never read."""

    rollout_id = "r1"


def test_a_local_holds_the_id_as_the_string_a_tokcap_attribute_a_key_or_one_level_down(
    walk: ModuleType,
) -> None:
    close = RolloutClose(rollout_id="r1")
    for held in ("r1", close, {"r1": 0}, [close], ("x", "r1"), {"r1"}, frozenset({"r1"})):
        assert walk.holds([held], "r1"), held
    for not_held in ("r2", "r1/c0", b"r1", RolloutClose(rollout_id="r2"), _Foreign(), {0: "r1"}):
        assert not walk.holds([not_held], "r1"), not_held
    assert not walk.holds([[[close]]], "r1")  # two levels down: not followed
    assert not walk.holds([[_Foreign()]], "r1")


def test_the_id_itself_is_the_string_a_key_or_an_item_never_what_holds_it(
    walk: ModuleType,
) -> None:
    close = RolloutClose(rollout_id="r1")
    for held in ("r1", {"r1": 0}, ("x", "r1"), ["r1"], {"r1"}, frozenset({"r1"})):
        assert walk.holds_itself([held], "r1"), held
    for only_held in (close, [close], (close, "x")):
        assert walk.holds([only_held], "r1"), only_held
        assert not walk.holds_itself([only_held], "r1"), only_held
    for not_held in ("r2", {0: "r1"}, [["r1"]], _Foreign()):
        assert not walk.holds_itself([not_held], "r1"), not_held


def _step(
    walk: ModuleType,
    module: str,
    *,
    gate: bool = True,
    resumed: bool = False,
    itself: bool = True,
) -> Any:
    return walk.Step(module, module.rsplit(".", 1)[-1] + ".f", gate, resumed, itself)


def test_a_stay_is_a_run_in_one_module_and_a_return_a_stay_in_a_module_left_before(
    walk: ModuleType,
) -> None:
    steps = [_step(walk, m) for m in ("a", "a", "b", "a", "c", "c", "b")]
    assert [m for m, _ in walk.stays_of(steps)] == ["a", "b", "a", "c", "b"]
    assert [len(f) for _, f in walk.stays_of(steps)] == [2, 1, 1, 2, 1]
    assert walk.returns_of(["a", "b", "a", "c", "b"]) == 2
    assert walk.returns_of(["a", "b", "c"]) == 0
    assert walk.returns_of([]) == 0


def test_the_gate_walk_takes_the_gates_own_starting_frames_of_each_request(
    walk: ModuleType,
) -> None:
    vllm, core = "tokcap_vllm._x", "tokcap_core._y"
    log = [
        _step(walk, "tokcap.compose._z", gate=False),  # before any request: (a) only
        "turn 1",
        _step(walk, vllm),
        _step(walk, core),  # the library: in (a), and on the every-package line
        _step(walk, "tokcap_vllm._w"),
        _step(walk, vllm, resumed=True),  # going on after an await: not a start
        _step(walk, "tokcap_vllm._v", gate=False),  # the driver's thread: (a) only
        _step(walk, vllm),
        "driver",
        _step(walk, vllm),  # between requests: not in any request's walk
        "close",
        _step(walk, vllm),
    ]
    figures = walk.figures(log)
    assert figures.modules == [
        "tokcap.compose._z",
        vllm,
        core,
        "tokcap_vllm._w",
        "tokcap_vllm._v",
    ]
    assert figures.stays["turn 1"] == [vllm, "tokcap_vllm._w", vllm]
    assert figures.returns == {"turn 1": 1, "turn 2": 0, "close": 0}
    assert figures.with_core["turn 1"] == (4, 1)
    assert figures.stays["close"] == [vllm]
    assert figures.max_returns == 1


def test_following_the_id_itself_leaves_out_the_frames_only_what_holds_it_reaches(
    walk: ModuleType,
) -> None:
    log = [
        "turn 1",
        _step(walk, "tokcap_vllm._a"),
        _step(walk, "tokcap_vllm._b", itself=False),  # only the call holds the id here
        _step(walk, "tokcap_vllm._a"),
        _step(walk, "tokcap_vllm._c"),
    ]
    held = walk.figures(log)
    itself = walk.figures(log, itself=True)
    assert held.modules == ["tokcap_vllm._a", "tokcap_vllm._b", "tokcap_vllm._c"]
    assert itself.modules == ["tokcap_vllm._a", "tokcap_vllm._c"]
    assert held.stays["turn 1"] == [
        "tokcap_vllm._a",
        "tokcap_vllm._b",
        "tokcap_vllm._a",
        "tokcap_vllm._c",
    ]
    assert held.returns["turn 1"] == 1
    assert itself.stays["turn 1"] == ["tokcap_vllm._a", "tokcap_vllm._c"]  # one stay in _a
    assert itself.returns["turn 1"] == 0


def test_the_tracer_counts_tokcap_frames_holding_the_id_and_tells_the_gates_threads(
    walk: ModuleType,
) -> None:
    tracer = walk.Tracer("tr-1")
    tracer.on = True

    def in_a_gate_thread() -> None:
        sys.setprofile(tracer.profile)
        try:
            Ledger("tr-1")
        finally:
            sys.setprofile(None)

    sys.setprofile(tracer.profile)
    try:
        Ledger("tr-2")  # another rollout: not counted
        tracer.mark("turn 1")
        Ledger("tr-1")
        tracer.quiet = True
        Ledger("tr-1")  # the driver waiting: not counted
        tracer.quiet = False
    finally:
        sys.setprofile(None)
    thread = threading.Thread(target=in_a_gate_thread)
    thread.start()
    thread.join()
    steps = [s for s in tracer.log if not isinstance(s, str)]
    assert tracer.log[0] == "turn 1"
    assert {s.module.split(".")[0] for s in steps} == {"tokcap_core"}
    driver = [s for s in steps if not s.gate]
    gate = [s for s in steps if s.gate]
    assert driver
    assert gate
    assert [s.function for s in driver] == [s.function for s in gate]
    assert "Ledger.__init__" in [s.function for s in gate]
    assert not any(s.resumed for s in steps)
    assert all(s.itself for s in steps if s.function == "Ledger.__init__")  # its argument
