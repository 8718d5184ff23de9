"""``tokcap train`` end to end, run as a user runs it: real vLLM engine, TransferQueue, Ray.

One run of 20 steps with a fixed seed (in a subprocess, on an existing two-node Ray cluster
given by ``--ray-address``, as a user with a cluster runs it) feeds every test: the loop must
learn (the digits reward of its last 5 steps well above its first 5), keep the trainer's
logprobs on the engine's after every push (K3 <= 1e-9 each step), push a strictly
increasing weight version that the next step's rows were sampled by, and verify every
receipt. Outcomes only: no assertion reads a duration.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import xml.dom.minidom
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
HANG_GUARD_S = 1800
STAGES = ("generate", "capture_verify", "reassemble", "train", "push")


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "COLUMNS": "120"}


@pytest.fixture(scope="module")
def cluster_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A two-node Ray cluster on loopback, held by its own process (tests/e2e/_cluster.py)."""
    tmp = tmp_path_factory.mktemp("cluster")
    with subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_cluster.py")), str(tmp)],
        cwd=REPO, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        assert holder.stdout is not None
        assert holder.stdin is not None
        address = holder.stdout.readline().strip()
        assert address, f"the cluster did not start (exit {holder.poll()})"
        try:
            yield address
        finally:
            holder.stdin.close()  # the holder stops its cluster and exits
            holder.wait(timeout=120)


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory, cluster_address: str) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("train") / "run"
    command = [sys.executable, "-m", "tokcap", "train", "--steps", str(STEPS), "--seed", "0"]
    proc = subprocess.run(
        [*command, "--out", str(out), "--ray-address", cluster_address],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"tokcap train failed ({proc.returncode}):\n{proc.stdout}\n" + (proc.stderr[-4000:])
    )
    return out, proc.stdout


def test_the_run_used_the_cluster_it_was_given(
    summary: dict[str, Any], cluster_address: str, train_run: tuple[Path, str]
) -> None:
    assert summary["config"]["ray_address"] == cluster_address


@pytest.fixture(scope="module")
def summary(train_run: tuple[Path, str]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((train_run[0] / "summary.json").read_text())
    return loaded


@pytest.fixture(scope="module")
def steps(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return list(summary["train"]["steps"])


def test_every_step_reports_what_the_issue_asks_for(steps: list[dict[str, Any]]) -> None:
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert set(s["parity"]) == {"tokens", "mean_abs", "max_abs", "k3"}
        assert 0.0 <= s["reward_mean"] <= s["reward_max"] <= 1.0
        assert isinstance(s["weight_version"], int)
        assert s["staleness_max"] == 0
        assert (s["rows_valid"], s["rows_placeholder"]) == (32, 0)
        assert set(STAGES) <= set(s["seconds"])
        assert s["seconds"]["total"] >= sum(s["seconds"][k] for k in STAGES) * 0.99


def test_the_policy_learns_the_task(summary: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """A random tiny model writes almost no digits; 20 steps of the loop teach it to."""
    rewards = [s["reward_mean"] for s in steps]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert early < 0.05
    assert late - early >= 0.3, rewards
    assert summary["train"]["reward_gain"] == pytest.approx(late - early)


def test_trainer_and_engine_agree_after_every_push(steps: list[dict[str, Any]]) -> None:
    """The trainer's pre-update logprobs on each step's captured ids match the engine's."""
    for s in steps:
        assert 0 < s["parity"]["tokens"] <= 32 * 16  # an answer may end before 16 tokens
        assert s["parity"]["k3"] <= 1e-9, s
        assert s["parity"]["max_abs"] < 1e-4, s


def test_each_push_lands_and_the_next_rows_are_sampled_by_it(steps: list[dict[str, Any]]) -> None:
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions))  # strictly increasing
    assert steps[0]["sampled_version"] == 0
    for before, after in itertools.pairwise(steps):
        assert after["sampled_version"] == before["weight_version"]
    assert all(s["engine_version"] == str(s["weight_version"]) for s in steps)


def test_every_receipt_verifies(summary: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    assert all(s["receipts_verified"] == s["receipts_total"] == 32 for s in steps)
    assert all(s["groups_accepted"] == 4 for s in steps)
    train = summary["train"]
    assert train["receipts_verified"] == train["receipts_total"] == 32 * STEPS


def test_the_report_draws_its_curves_without_the_network(train_run: tuple[Path, str]) -> None:
    page = (train_run[0] / "report.html").read_text()
    assert "http://" not in page
    assert "https://" not in page
    charts = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(charts) == 5  # reward, parity, staleness, loop lag, step time
    for chart in charts:
        xml.dom.minidom.parseString(chart)  # well-formed
    reward, parity = charts[0], charts[1]
    assert reward.count("<circle") == 2 * STEPS  # mean and best, one point per step
    assert parity.count("<circle") == 2 * STEPS  # K3 and mean |Δ|
    assert "K3 bound 1e-9" in parity
    assert charts[2].count("<circle") == STEPS  # max staleness, one point per step


def test_show_reprints_the_training_summary(train_run: tuple[Path, str]) -> None:
    out, printed = train_run
    shown = subprocess.run(
        [sys.executable, "-m", "tokcap", "show", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "tokcap train: closed GRPO loop" in shown.stdout
    assert "receipts verified" in shown.stdout
    assert "check failed" not in printed
