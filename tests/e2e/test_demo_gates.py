"""``tokcap demo --gate URL --gate URL --ray-address``: the demo's harness through two
``tokcap-vllm serve`` processes someone else started.

One small run (a subprocess, as a user runs it) against the shared fleet (``served_fleet``,
tests/conftest.py: gates started with the real CLI and the options ``--gates N`` gives
its own, staging into the cluster's TransferQueue); every rollout is opened through
`tokcap_vllm.GateFleet`; the summary and the report show the fleet. ``tokcap train --gates
2`` (tests/e2e/test_train_gates.py) starts gates through the same `tokcap.compose` code
the demo's ``--gates`` uses. Outcomes only.
"""

from __future__ import annotations

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


def test_the_demo_runs_through_two_served_gates(served_fleet: SharedFleet, tmp_path: Path) -> None:
    version = served_fleet.initial_weights()
    urls = served_fleet.urls
    out = tmp_path / "run"
    env = {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "COLUMNS": "120",
        "TOKCAP_CONTROL_TOKEN": served_fleet.token,
    }
    command = [sys.executable, "-m", "tokcap", "demo", "--groups", "2"]
    command += [arg for url in urls for arg in ("--gate", url)]
    command += ["--ray-address", served_fleet.address]
    proc = subprocess.run(
        [*command, "--rollouts", "4", "--turns", "2", "--max-tokens", "12", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"tokcap demo failed ({proc.returncode}):\n{proc.stdout}\n" + (proc.stderr[-4000:])
    )
    assert "gates (tokcap-vllm serve)" in proc.stdout  # the fleet table
    summary = json.loads((out / "summary.json").read_text())
    gates = summary["gates"]
    assert [g["url"] for g in gates] == urls
    assert [g["pid"] for g in gates] == [None, None]  # started elsewhere
    assert [g["rollouts"] for g in gates] == [4, 4]  # the fleet spreads the rollouts
    assert all(g["calls"] >= g["rollouts"] and g["alive"] for g in gates)
    assert [g["weight_version"] for g in gates] == [version, version]  # the demo never pushes
    assert summary["rollouts"]["total"] == 8
    assert summary["engine_parity"]["rows_differing"] == 0  # rows are the engines' own ids
    assert summary["rows"]["verified"] == summary["rows"]["valid"] > 0
    page = (out / "report.html").read_text()
    assert "Fleet: 2 gates" in page
    assert all(g["url"] in page for g in gates)
