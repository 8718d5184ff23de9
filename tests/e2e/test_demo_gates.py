"""``tokcap demo --gates 2``: the demo's harness through two ``tokcap-vllm serve`` processes.

One small run (a subprocess, as a user runs it): the gates are started with the real CLI,
stage into the run's TransferQueue, and every rollout is opened through
`tokcap_vllm.GateFleet`; the summary and the report show the fleet. Outcomes only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 1200


def test_the_demo_runs_through_two_served_gates(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "COLUMNS": "120"}
    command = [sys.executable, "-m", "tokcap", "demo", "--gates", "2", "--groups", "2"]
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
    assert len({g["pid"] for g in gates}) == len({g["url"] for g in gates}) == 2
    assert os.getpid() not in [g["pid"] for g in gates]
    assert [g["rollouts"] for g in gates] == [4, 4]  # the fleet spreads the rollouts
    assert all(g["calls"] >= g["rollouts"] and g["alive"] for g in gates)
    assert [g["weight_version"] for g in gates] == [0, 0]
    assert summary["rollouts"]["total"] == 8
    assert summary["engine_parity"]["rows_differing"] == 0  # rows are the engines' own ids
    assert summary["rows"]["verified"] == summary["rows"]["valid"] > 0
    page = (out / "report.html").read_text()
    assert "Fleet: 2 gates" in page
    assert all(g["url"] in page for g in gates)
