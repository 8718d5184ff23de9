"""Trainers against gates started by hand, as a team with its own vLLM servers runs them.

A Ray cluster with TransferQueue is held by its own process (``tests/e2e/_cluster.py
--tq``); two ``tokcap-vllm serve --tokcap-sink tq`` gates are started with the real CLI
against it; then two trainers come and go, each in its own process, joining the cluster
with ``--ray-address``: ``examples/custom_trainer.py --gate URL --gate URL`` (rows equal
to the engine's ids) and ``tokcap train --gate URL --gate URL`` (a closed loop, weights
pushed into gates it did not start). Outcomes only.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e._cluster import held_cluster
from tests.e2e._gates import ServedGate
from tokcap.compose import served_gate_options
from tokcap_tq import TQSinkConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hand-started-" + secrets.token_hex(8)
HANG_GUARD_S = 1200


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "COLUMNS": "120",
        "TOKCAP_CONTROL_TOKEN": TOKEN,
    }


@pytest.fixture(scope="module")
def cluster_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A two-node loopback Ray cluster running TransferQueue, held by its own process."""
    with held_cluster(tmp_path_factory.mktemp("cluster"), _env(), tq=True) as address:
        yield address


@pytest.fixture(scope="module")
def gate_urls(
    cluster_address: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[str]]:
    """Two gates started by hand: the default partitions, ids returned to harnesses."""
    from tokcap.tiny import build_tiny_model

    # the model `tokcap train` (run in the repository) loads as its policy
    model = build_tiny_model(REPO / ".tokcap" / "tiny" / "dense", kind="dense")
    logs = tmp_path_factory.mktemp("gates")
    options = [*served_gate_options(TQSinkConfig(), cluster_address), "--tokcap-return-token-ids"]
    gates = [ServedGate(model, options, token=TOKEN, log=logs / f"gate{i}.log") for i in range(2)]
    try:
        for gate in gates:
            gate.wait_healthy(TOKEN)
        yield [g.url for g in gates]
    finally:
        for gate in gates:
            gate.stop()


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{command[1:4]} failed ({proc.returncode}):\n{proc.stdout}\n" + (proc.stderr[-4000:])
    )
    return proc


def test_the_example_trainer_composes_against_hand_started_gates(
    cluster_address: str, gate_urls: list[str]
) -> None:
    gates = [arg for url in gate_urls for arg in ("--gate", url)]
    example = str(REPO / "examples" / "custom_trainer.py")
    proc = _run([sys.executable, example, "--ray-address", cluster_address, *gates])
    assert "receipts verified 6/6" in proc.stdout
    assert "rows equal to the engine's ids 6/6" in proc.stdout


def test_tokcap_train_trains_through_hand_started_gates(
    cluster_address: str, gate_urls: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    gates = [arg for url in gate_urls for arg in ("--gate", url)]
    command = [sys.executable, "-m", "tokcap", "train", "--steps", "2", "--groups", "2"]
    _run([*command, "--rollouts", "4", "--ray-address", cluster_address, *gates, "--out", str(out)])
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
