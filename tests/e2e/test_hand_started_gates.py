"""Trainers against gates started by hand, as a team with its own vLLM servers runs them.

The gates are the shared fleet's (``served_fleet``, tests/conftest.py): two
``tokcap-vllm serve --tokcap-sink tq`` processes started with the real CLI against a Ray
cluster running TransferQueue (the session's). Two trainers come and go, each in its own
process, joining the cluster with ``--ray-address``: ``examples/custom_trainer.py --gate
URL --gate URL`` (rows equal to the engine's ids) and ``tokcap train --gate URL --gate
URL`` (a closed loop, weights pushed into gates it did not start). Outcomes only.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e._fleet import SharedFleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 1200


def _env(token: str) -> dict[str, str]:
    return {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "COLUMNS": "120",
        "TOKCAP_CONTROL_TOKEN": token,
    }


@pytest.fixture
def cluster_address(served_fleet: SharedFleet) -> str:
    """The Ray cluster (running TransferQueue) the gates stage into."""
    return served_fleet.address


@pytest.fixture
def gate_urls(served_fleet: SharedFleet) -> list[str]:
    """Two gates started by hand: the default partitions, ids returned to harnesses, serving
    the model `tokcap train` (run in the repository) loads as its policy."""
    return served_fleet.urls


def _run(command: list[str], token: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        command, cwd=REPO, env=_env(token), capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{command[1:4]} failed ({proc.returncode}):\n{proc.stdout}\n" + (proc.stderr[-4000:])
    )
    return proc


def test_the_example_trainer_composes_against_hand_started_gates(
    cluster_address: str, gate_urls: list[str], served_fleet: SharedFleet
) -> None:
    gates = [arg for url in gate_urls for arg in ("--gate", url)]
    example = str(REPO / "examples" / "custom_trainer.py")
    command = [sys.executable, example, "--ray-address", cluster_address, *gates]
    proc = _run(command, served_fleet.token)
    assert "receipts verified 6/6" in proc.stdout
    assert "rows equal to the engine's ids 6/6" in proc.stdout


def test_tokcap_train_trains_through_hand_started_gates(
    cluster_address: str, gate_urls: list[str], served_fleet: SharedFleet, tmp_path: Path
) -> None:
    served_fleet.initial_weights()  # the policy `tokcap train` loads is what the gates serve
    out = tmp_path / "run"
    gates = [arg for url in gate_urls for arg in ("--gate", url)]
    command = [sys.executable, "-m", "tokcap", "train", "--steps", "2", "--groups", "2"]
    command += ["--rollouts", "4", "--ray-address", cluster_address, *gates, "--out", str(out)]
    _run(command, served_fleet.token)
    summary = json.loads((out / "summary.json").read_text())
    assert [g["url"] for g in summary["gates"]] == gate_urls
    assert [g["pid"] for g in summary["gates"]] == [None, None]  # started elsewhere
    assert all(g["rollouts"] > 0 for g in summary["gates"])
    steps = summary["train"]["steps"]
    for s in steps:
        assert s["receipts_verified"] == s["receipts_total"] > 0
        assert s["parity"]["k3"] <= 1e-9
        assert s["gate_versions"] == [s["weight_version"]] * 2
    for previous, s in itertools.pairwise(steps):
        assert s["sampled_version"] == previous["weight_version"]
