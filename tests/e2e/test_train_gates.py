"""``tokcap train --gates 2``: the closed loop through two ``tokcap-vllm serve`` processes.

The run (a subprocess, as a user runs it) starts local Ray + TransferQueue, then two gates
with the real CLI (``--tokcap-sink tq``, ``--tokcap-require-open``, the ``tokcap_shm``
weight-transfer backend); every rollout is opened through `tokcap_vllm.GateFleet` and every
push goes through `tokcap_vllm.weights.FleetWeightSync`. A few steps only (CI's budget);
outcomes only, no assertion reads a duration.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import pytest

from tests.e2e._cli import tokcap

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3
HANG_GUARD_S = 1800


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("train-gates") / "run"
    proc = tokcap(
        "train", "--gates", "2", "--steps", str(STEPS),
        "--groups", "2", "--rollouts", "4", "--seed", "0", "--out", out, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"tokcap train failed ({proc.returncode}):\n{proc.stdout}\n" + proc.stderr[-4000:]
    )
    assert "gates (tokcap-vllm serve)" in proc.stdout  # the fleet table
    loaded: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return loaded


def test_two_gate_processes_each_served_rollouts(summary: dict[str, Any]) -> None:
    gates = summary["gates"]
    assert len(gates) == 2
    pids = [g["pid"] for g in gates]
    assert all(isinstance(p, int) for p in pids)
    assert len(set(pids)) == 2
    assert os.getpid() not in pids
    assert len({g["url"] for g in gates}) == 2
    assert all(g["rollouts"] > 0 and g["calls"] >= g["rollouts"] for g in gates)
    steps = summary["train"]["steps"]
    rollouts = summary["config"]["groups"] * summary["config"]["rollouts"]
    assert sum(g["rollouts"] for g in gates) == rollouts * len(steps)


def test_every_receipt_verified_and_parity_held_every_step(summary: dict[str, Any]) -> None:
    steps = summary["train"]["steps"]
    assert len(steps) == STEPS
    for s in steps:
        assert s["receipts_verified"] == s["receipts_total"] > 0
        assert s["parity"]["k3"] <= 1e-9
        assert s["rows_valid"] > 0


def test_both_gates_serve_the_pushed_version_after_every_push(summary: dict[str, Any]) -> None:
    steps = summary["train"]["steps"]
    for previous, s in itertools.pairwise(steps):
        assert s["weight_version"] > previous["weight_version"]
        assert s["sampled_version"] == previous["weight_version"]
    for s in steps:
        assert s["gate_versions"] == [s["weight_version"]] * 2
        assert s["engine_version"] == str(s["weight_version"])
    assert [g["weight_version"] for g in summary["gates"]] == [steps[-1]["weight_version"]] * 2
