"""``tokcap train``'s figures (``summary.json``), its checks, and their rich rendering.

The summary is plain JSON: ``train.steps[i]`` is one step (reward, parity of the
trainer's pre-update logprobs against the engine's, the weight version pushed, the
version that sampled the rows, staleness, rows, receipts, per-stage seconds), followed
by the run's aggregates. `train_problems` lists every invariant of a closed loop that
does not hold; `tokcap train` exits 1 when there is one.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from ..demo import print_fleet

if TYPE_CHECKING:  # `tokcap show` must not import Ray, vLLM or TransferQueue
    from ._loop import TrainRun

__all__ = ["build_train_summary", "print_train_summary", "train_problems"]

SUMMARY_VERSION = 1
PARITY_K3 = 1e-9
"""The most K3 a step may show (fp32 trainer and engine on the same weights: ~1e-14)."""
STAGES = ("generate", "capture_verify", "reassemble", "train", "push")
WINDOW = 5
"""Steps averaged at each end of the run for the reward gain."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def build_train_summary(run: TrainRun, timings_s: dict[str, float]) -> dict[str, Any]:
    """Every figure of a training run as plain JSON (the report and ``tokcap show`` read it)."""
    config = run.config
    steps = [record.as_json() for record in run.steps]
    rewards = [s["reward_mean"] for s in steps]
    totals = [s["seconds"]["total"] for s in steps]
    stage_s = {name: sum(s["seconds"].get(name, 0.0) for s in steps) for name in STAGES}
    all_stages = sum(stage_s.values()) or 1.0
    k3 = [s["parity"]["k3"] for s in steps]
    staleness = [s["staleness_max"] for s in steps if s["staleness_max"] is not None]
    return {
        "version": SUMMARY_VERSION,
        "kind": "train",
        "config": {
            "steps": config.steps,
            "groups": config.groups,
            "rollouts": config.rollouts,
            "turns": config.turns,
            "max_tokens": config.max_tokens,
            "lr": config.lr,
            "seed": config.seed,
            "ray_address": config.ray_address,
            "task": "digits: reward = share of the answer's non-space characters that are digits",
            "model_params": run.params,
        },
        "train": {
            "steps": steps,
            "reward_first5": _mean(rewards[:WINDOW]),
            "reward_last5": _mean(rewards[-WINDOW:]),
            "reward_gain": _mean(rewards[-WINDOW:]) - _mean(rewards[:WINDOW]),
            "parity_k3_max": max(k3, default=0.0),
            "parity_k3_limit": PARITY_K3,
            "parity_mean_abs_max": max((s["parity"]["mean_abs"] for s in steps), default=0.0),
            "weight_versions": [s["weight_version"] for s in steps],
            "staleness_max": max(staleness, default=None),
            "rows_valid": sum(s["rows_valid"] for s in steps),
            "rows_placeholder": sum(s["rows_placeholder"] for s in steps),
            "receipts_verified": sum(s["receipts_verified"] for s in steps),
            "receipts_total": sum(s["receipts_total"] for s in steps),
            "seconds_per_step_median": statistics.median(totals) if totals else 0.0,
            "stage_seconds": {k: round(v, 3) for k, v in stage_s.items()},
            "stage_shares": {k: round(v / all_stages, 4) for k, v in stage_s.items()},
        },
        "gates": run.gates,
        "samples": [
            {"step": step, "answer": answer, "reward": round(reward, 4)}
            for step, answer, reward in run.samples
        ],
        "timings_s": {k: round(v, 3) for k, v in timings_s.items()},
    }


def train_problems(summary: dict[str, Any]) -> list[str]:
    """The closed loop's invariants, as one message for each that does not hold."""
    problems = []
    previous: dict[str, Any] | None = None
    for s in summary["train"]["steps"]:
        at = f"step {s['step']}"
        k3 = s["parity"]["k3"]
        if not (math.isfinite(k3) and k3 <= PARITY_K3):
            problems.append(f"{at}: parity K3 {k3:.2e} > {PARITY_K3:.0e} (a push did not land)")
        if s["receipts_verified"] != s["receipts_total"]:
            problems.append(f"{at}: {s['receipts_total'] - s['receipts_verified']} receipts fail")
        if s["rows_valid"] == 0:
            problems.append(f"{at}: no valid row")
        if s["engine_version"] != str(s["weight_version"]):
            problems.append(f"{at}: the engine serves {s['engine_version']!r}, not the push")
        if previous is not None:
            if s["weight_version"] <= previous["weight_version"]:
                problems.append(f"{at}: the weight version did not increase")
            if s["sampled_version"] != previous["weight_version"]:
                problems.append(f"{at}: rows sampled by version {s['sampled_version']}, not "
                                f"the one pushed after step {previous['step']}")  # fmt: skip
        if any(v != s["weight_version"] for v in s.get("gate_versions", [])):
            problems.append(f"{at}: gates at versions {s['gate_versions']} after the push")
        if s["staleness_max"] not in (0, None):
            problems.append(f"{at}: stale rows (staleness {s['staleness_max']})")
        previous = s
    for gate in summary.get("gates", []):
        if gate["rollouts"] == 0:
            problems.append(f"gate {gate['url']} served no rollout")
    return problems


def summary_console() -> Console:
    """The console the summary prints to (stdout, wide enough for the tables)."""
    return Console(width=max(Console().width, 100))


def print_train_summary(summary: dict[str, Any], console: Console) -> None:
    """The run at a glance: a step table (at most ~12 rows), then the totals."""
    train = summary["train"]
    steps = train["steps"]
    table = Table(title="tokcap train: closed GRPO loop", box=box.SIMPLE_HEAVY)
    for name in ("step", "reward", "parity K3", "mean |Δ|", "version", "rows", "receipts", "s"):
        table.add_column(name, justify="right")
    every = max(1, math.ceil(len(steps) / 12))
    for s in steps:
        if s["step"] % every and s is not steps[-1]:
            continue
        table.add_row(
            str(s["step"]),
            f"{s['reward_mean']:.3f}",
            f"{s['parity']['k3']:.1e}",
            f"{s['parity']['mean_abs']:.1e}",
            f"{s['sampled_version']}→{s['weight_version']}",
            f"{s['rows_valid']}+{s['rows_placeholder']}",
            f"{s['receipts_verified']}/{s['receipts_total']}",
            f"{s['seconds']['total']:.1f}",
        )
    console.print(table)
    print_fleet(summary.get("gates", []), console)
    shares = ", ".join(f"{k} {v:.0%}" for k, v in train["stage_shares"].items())
    ok = train["parity_k3_max"] <= train["parity_k3_limit"]
    console.print(
        f"reward (mean of {WINDOW} steps): first {train['reward_first5']:.3f} → last "
        f"{train['reward_last5']:.3f} ([bold]{train['reward_gain']:+.3f}[/])\n"
        f"parity: max K3 {train['parity_k3_max']:.1e} "
        f"({'[green]≤' if ok else '[red]>'} {train['parity_k3_limit']:.0e}[/]) over "
        f"{len(steps)} steps; receipts verified {train['receipts_verified']}/"
        f"{train['receipts_total']}; weight versions {train['weight_versions'][:1]}…"
        f"{train['weight_versions'][-1:]}\n"
        f"a step: {train['seconds_per_step_median']:.1f} s (median); {shares}",
        highlight=False,
    )
