"""``tokcap train`` end to end, run as a user runs it: real vLLM engine, TransferQueue, Ray.

One run of 20 steps with a fixed seed (in a subprocess, on an existing Ray cluster running
TransferQueue, given by ``--ray-address``, as a user with a cluster runs it: the session's,
``tq_cluster``) feeds every test: the loop must
learn (the digits reward of its last 5 steps well above its first 5), keep the trainer's
logprobs on the engine's after every push (K3 <= 1e-9 each step), push a strictly
increasing weight version that the next step's rows were sampled by, and verify every
receipt. Outcomes only: no assertion reads a duration.
"""

from __future__ import annotations

import itertools
import json
import re
import xml.dom.minidom
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._cli import tokcap

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 20
HANG_GUARD_S = 1800
STAGES = ("generate", "capture_verify", "reassemble", "train", "push")


@pytest.fixture(scope="module")
def cluster_address(tq_cluster: Any) -> str:
    """The session's loopback Ray, TransferQueue running on it (the trainers attach to it
    and leave it running; tests/ray/test_multinode.py covers a multi-node cluster)."""
    import ray

    address: str = ray.get_runtime_context().gcs_address
    return address


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory, cluster_address: str) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("train") / "run"
    proc = tokcap(
        "train", "--steps", str(STEPS), "--seed", "0", "--out", out,
        "--ray-address", cluster_address, timeout=HANG_GUARD_S,
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
        assert 0 < s["parity"]["tokens"] <= 32 * 16 * 2  # two calls; one may end early
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
    assert len(charts) == 6  # reward, parity, staleness, loop lag, rollout shapes, step time
    for chart in charts:
        xml.dom.minidom.parseString(chart)  # well-formed
    reward, parity = charts[0], charts[1]
    assert reward.count("<circle") == 2 * STEPS  # mean and best, one point per step
    assert parity.count("<circle") == 2 * STEPS  # K3 and mean |Δ|
    assert "K3 bound 1e-9" in parity
    assert charts[2].count("<circle") == STEPS  # max staleness, one point per step
    # the shapes played: every rollout of the agent task made its two calls
    assert "calls per rollout</th><td>2: 640 (100%)</td>" in page
    assert charts[4].count("<circle") == 2 * STEPS  # row length p90, calls in flight


def test_show_reprints_the_training_summary(train_run: tuple[Path, str]) -> None:
    out, printed = train_run
    shown = tokcap("show", out, timeout=120, check=True)
    assert "tokcap train: closed GRPO loop" in shown.stdout
    assert "receipts verified" in shown.stdout
    assert "check failed" not in printed


# ---- --async on the same cluster: a few steps, outcomes only ------------------------------

ASYNC_STEPS = 4


@pytest.fixture(scope="module")
def async_summary(tmp_path_factory: pytest.TempPathFactory, cluster_address: str) -> dict[str, Any]:
    """``tokcap train --async --max-staleness 1 --task long-tail``, a few small steps: the
    task where asynchronous pays (`tokcap.loop.long_tail_shape`)."""
    out = tmp_path_factory.mktemp("train-async") / "run"
    proc = tokcap(
        "train", "--async", "--max-staleness", "1", "--steps", str(ASYNC_STEPS),
        "--task", "long-tail",
        "--groups", "2", "--rollouts", "4", "--seed", "0",
        "--out", out, "--ray-address", cluster_address, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"tokcap train --async failed ({proc.returncode}):\n{proc.stdout}\n" + proc.stderr[-4000:]
    )
    loaded: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return loaded


def test_async_trains_within_the_bound_and_verifies_every_receipt(
    async_summary: dict[str, Any],
) -> None:
    train = async_summary["train"]
    assert (train["mode"], train["max_staleness"], train["importance"]) == ("async", 1, True)
    steps = train["steps"]
    assert [s["step"] for s in steps] == list(range(ASYNC_STEPS))
    assert train["receipts_verified"] == train["receipts_total"] == 8 * ASYNC_STEPS
    for s in steps:
        assert s["groups_accepted"] == 2
        assert s["staleness_max"] is not None
        assert 0 <= s["staleness_max"] <= 1
        assert s["tokens_stale_kv"] == 0  # pushes recompute the KV of calls in flight
        assert s["loop_lag_ms_max"] >= 0.0
        fresh = s["parity_by_staleness"].get("0")
        assert fresh is None or fresh["k3"] <= 1e-9, s  # rows of the trained version agree
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions))
    for before, after in itertools.pairwise(steps):  # never sampled by weights not yet pushed
        assert after["sampled_version"] <= before["weight_version"]
    assert async_summary["config"]["task"].startswith("long-tail")
    # the long tail was played: short rollouts and 6-10-call ones, each call captured
    played: dict[int, int] = {}
    for s in steps:
        for calls, n in s["calls_per_rollout"].items():
            played[int(calls)] = played.get(int(calls), 0) + n
    assert sum(played.values()) == 8 * ASYNC_STEPS
    assert set(played) <= {1, 2, 6, 7, 8, 9, 10}
    assert min(played) <= 2, played
    assert max(played) >= 6, played
    assert all(len(s["row_tokens"]) == s["rows_valid"] for s in steps)
