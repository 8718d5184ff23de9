"""Every single-field change of a Gym record, receipt or snapshot list is detected, or is
documented as irrelevant to what a trainer learns (``tamper_rules``)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.interop.gymkit import CallSpec, build_capture, capture_json, f32, worked_example
from tests.core.interop.tamper_rules import sweep
from tokcap_core import assemble_receipt
from tokcap_core.interop import gym
from tokcap_core.testing import simulated_rollouts

_SWEEP = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stranger() -> dict[str, Any]:
    return worked_example("someone-else").snapshots[0].to_json()


def test_the_worked_example_detects_every_tamper() -> None:
    counts = sweep(*capture_json(worked_example()), stranger())
    assert counts["receipt:detected"] > 50
    assert counts["record:detected"] > 50
    assert counts["receipt:reselected"] == 1  # c2 -> c1, a shorter but genuine chain
    assert set(counts) <= {
        "receipt:detected", "receipt:equivalent", "receipt:irrelevant", "receipt:reselected",
        "record:detected", "record:equivalent", "record:withheld", "list:detected",
    }  # fmt: skip


@st.composite
def gym_captures(draw: Any) -> gym.GymCapture:
    """Gym-native captures: a tree of calls, some with routes, declared or heuristic."""
    count = draw(st.integers(1, 4))
    specs: list[CallSpec] = []
    for i in range(count):
        parent = draw(st.sampled_from([None, *[s.call_id for s in specs]])) if i else None
        carry = draw(st.lists(st.integers(0, 2**32 - 1), min_size=0 if parent else 1, max_size=3))
        gen = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=3))
        extras = None
        if draw(st.booleans()):
            rows = [[[draw(st.integers(-1, 7))]] for _ in range(len(carry) + len(gen))]
            extras = {"routed_experts": rows}
        specs.append(
            CallSpec(
                f"c{i + 1}",
                parent,
                tuple(carry),
                tuple(gen),
                tuple(f32(-draw(st.floats(0, 4))) for _ in gen),
                weight_version=draw(st.integers(0, 3)),
                extras=extras,
                admitted_at=draw(st.none() | st.floats(0, 1e9)),
            )
        )
    picked, _ = gym.select_gym_terminal(
        build_capture(
            "probe", specs, terminal=None, selection=None, poisoned=True, failure_reason="x"
        ).receipt.manifest
    )
    heuristic = picked is not None and draw(st.booleans())
    terminal = picked if heuristic else draw(st.sampled_from([s.call_id for s in specs]))
    return build_capture(
        draw(st.sampled_from(["g7_r0", "rollout.1"])),
        specs,
        terminal=terminal,
        selection="heuristic" if heuristic else "declared",
        reward=draw(st.none() | st.floats(-1, 1)),
        schema_version=draw(st.sampled_from([2, 3])),
    )


@_SWEEP
@given(gym_captures())
def test_gym_native_captures_detect_every_tamper(capture: gym.GymCapture) -> None:
    receipt, snapshots = capture_json(capture)
    counts = sweep(receipt, snapshots, stranger())
    assert counts["record:detected"] > 0


@_SWEEP
@given(simulated_rollouts(max_turns=3, max_roots=2))
def test_exported_tokcap_captures_detect_every_tamper(rollout: Any) -> None:
    receipt = assemble_receipt(rollout.ledger.state)
    if not receipt.ok:
        return
    capture = gym.export_gym_capture(receipt, rollout.calls, state=rollout.ledger.state)
    counts = sweep(*capture_json(capture), stranger())
    assert counts["record:detected"] > 0
