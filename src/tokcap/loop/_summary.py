"""``tokcap train``'s figures (``summary.json``), its checks, and their rich rendering.

The summary is plain JSON: ``train.steps[i]`` is one step (reward, parity of the
trainer's pre-update logprobs against the engine's, the weight version pushed, the
version that sampled the rows, staleness, rows, receipts, per-stage seconds), followed
by the run's aggregates. `train_problems` lists every invariant of a closed loop that
does not hold; `tokcap train` exits 1 when there is one. A receipt lost with its gate
(poisoned ``gate_unreachable``: the gate stopped answering, `tokcap.compose.lost_receipts`)
is counted in ``receipts_lost`` by gate, not as a failed verification: a run that lost a
gate and trained on the rest passes, as long as that gate is reported lost.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from .._fleet_view import print_fleet

if TYPE_CHECKING:  # `tokcap show` must not import Ray, vLLM or TransferQueue
    from ._step import TrainRun

__all__ = ["build_train_summary", "print_train_summary", "tokcap_share", "train_problems"]

SUMMARY_VERSION = 1
PARITY_K3 = 1e-9
"""The most K3 a step may show (fp32 trainer and engine on the same weights: ~1e-14)."""
STAGES = ("generate", "capture_verify", "reassemble", "train", "push")
TASK_NOTES = {
    "agent": "agent: the answers with a digit checker's tool result between calls; reward = "
    "share of the answers' non-space characters that are digits",
    "digits": "digits: reward = share of the answers' non-space characters that are digits",
    "long-tail": "long-tail: the agent task, 4 rollouts in 5 making 1-2 calls and the 5th 6-10 "
    "calls of 4x the tokens; reward = share of the answers' non-space characters that are digits",
}
WINDOW = 5
"""Steps averaged at each end of the run for the reward gain."""
IMAGE_COUNTS = ("images_sent", "images_bound", "images", "image_blobs")
"""A vision-language run's image counts, per step and in total (absent for text)."""


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
    fresh = [s.get("parity_by_staleness", {}).get("0") for s in steps]
    k3 = [
        (p["k3"] if p else 0.0) if config.mode == "async" else s["parity"]["k3"]
        for s, p in zip(steps, fresh, strict=True)
    ]
    staleness = [s["staleness_max"] for s in steps if s["staleness_max"] is not None]
    images = {name: sum(s.get(name, 0) for s in steps) for name in IMAGE_COUNTS}
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
            "task": TASK_NOTES[config.task],
            "model_family": config.model_family,
            "model_params": run.params,
        },
        "train": {
            "mode": config.mode,
            "max_staleness": config.max_staleness if config.mode == "async" else 0,
            "importance": config.decoupled,
            "steps": steps,
            "reward_first5": _mean(rewards[:WINDOW]),
            "reward_last5": _mean(rewards[-WINDOW:]),
            "reward_gain": _mean(rewards[-WINDOW:]) - _mean(rewards[:WINDOW]),
            "parity_k3_max": max(k3, default=0.0),
            "parity_k3_max_all_rows": max((s["parity"]["k3"] for s in steps), default=0.0),
            "parity_k3_limit": PARITY_K3,
            "parity_mean_abs_max": max((s["parity"]["mean_abs"] for s in steps), default=0.0),
            "weight_versions": [s["weight_version"] for s in steps],
            "staleness_max": max(staleness, default=None),
            "tokens_stale": sum(s["tokens_stale"] for s in steps),
            "calls_spanning_versions": sum(s["calls_spanning_versions"] for s in steps),
            "tokens_stale_kv": sum(s["tokens_stale_kv"] for s in steps),
            "dropped_stale": sum(s["dropped_stale"] for s in steps),
            "skipped": steps[-1]["skipped"] if steps else {},
            "loop_lag_ms_max": round(run.loop_lag_ms_max, 3),
            "samples_per_s": _samples_per_s(config, totals),
            "tokcap_share": round(_mean([tokcap_share(s["seconds"]) for s in steps[1:]]), 4),
            "rows_valid": sum(s["rows_valid"] for s in steps),
            "rows_placeholder": sum(s["rows_placeholder"] for s in steps),
            "receipts_verified": sum(s["receipts_verified"] for s in steps),
            "receipts_total": sum(s["receipts_total"] for s in steps),
            "receipts_lost": sum(sum(s["receipts_lost"].values()) for s in steps),
            "receipts_lost_by_gate": _lost_by_gate(steps),
            "terminals": _terminals(steps),
            "seconds_per_step_median": statistics.median(totals) if totals else 0.0,
            "stage_seconds": {k: round(v, 3) for k, v in stage_s.items()},
            "stage_shares": {k: round(v / all_stages, 4) for k, v in stage_s.items()},
            **(images if images["images_sent"] else {}),
        },
        "gates": run.gates,
        "samples": [
            {"step": step, "answer": answer, "reward": round(reward, 4)}
            for step, answer, reward in run.samples
        ],
        "timings_s": {k: round(v, 3) for k, v in timings_s.items()},
    }


def _terminals(steps: list[dict[str, Any]]) -> dict[str, int]:
    """Verified receipts of the run by how their terminal call was chosen."""
    counts: Counter[str] = Counter()
    for s in steps:
        counts.update(s.get("terminals", {}))
    return dict(sorted(counts.items()))


def _lost_by_gate(steps: list[dict[str, Any]]) -> dict[str, int]:
    lost: dict[str, int] = {}
    for s in steps:
        for url, n in s["receipts_lost"].items():
            lost[url] = lost.get(url, 0) + n
    return lost


def tokcap_share(seconds: dict[str, float]) -> float:
    """The share of a step's wall time the loop spent blocked on tokcap's own work.

    Sync: what was left of collecting the groups (closes with their declarations,
    receipts, reassembly, reading rows) once the last answer came back
    (``capture_verify`` + ``reassemble``; the collecting done while other groups still
    generated blocks nothing). Async (a step with ``wait``): collecting runs beside
    generation and training; what blocks the train pump is waiting for a group that has
    played but is not collected yet (``collect_wait``), and reading rows if it does
    (``fetch_rows``).
    """
    total = seconds.get("total", 0.0)
    if not total:
        return 0.0
    if "wait" in seconds or "fetch_rows" in seconds:
        return (seconds.get("fetch_rows", 0.0) + seconds.get("collect_wait", 0.0)) / total
    return (seconds.get("capture_verify", 0.0) + seconds.get("reassemble", 0.0)) / total


def _samples_per_s(config: Any, totals: list[float]) -> float:
    """Rollouts trained per second of the steps (their summed wall time)."""
    elapsed = sum(totals)
    return round(len(totals) * config.groups * config.rollouts / elapsed, 3) if elapsed else 0.0


def train_problems(summary: dict[str, Any]) -> list[str]:
    """The closed loop's invariants, as one message for each that does not hold.

    Sync: every row sampled by the version the last step pushed, staleness 0, K3 within
    the limit. Async: rows sampled no later than that version and no token more than
    ``max_staleness`` versions behind; the K3 limit applies to the rows sampled by the
    trained version itself (staleness 0), as stale rows differ by design.
    """
    train = summary["train"]
    is_async = train.get("mode") == "async"
    bound = train.get("max_staleness", 0) if is_async else 0
    problems = []
    previous: dict[str, Any] | None = None
    lost_gates = {g["url"] for g in summary.get("gates", []) if not g.get("alive", True)}
    for s in train["steps"]:
        at = f"step {s['step']}"
        lost = s.get("receipts_lost", {})
        excused = sum(n for url, n in lost.items() if url in lost_gates)
        for url, n in lost.items():
            if url not in lost_gates:
                problems.append(f"{at}: {n} receipts lost on gate {url}, which still answers")
        fresh = s.get("parity_by_staleness", {}).get("0") if is_async else s["parity"]
        k3 = fresh["k3"] if fresh else 0.0
        if not (math.isfinite(k3) and k3 <= PARITY_K3):
            problems.append(f"{at}: parity K3 {k3:.2e} > {PARITY_K3:.0e} (a push did not land)")
        failed = s["receipts_total"] - s["receipts_verified"] - excused
        if failed:
            problems.append(f"{at}: {failed} receipts fail ({s.get('placeholders', {})})")
        declared = s.get("terminals", {}).get("declared", 0)
        if not failed and not excused and declared != s.get("declared", 0):
            problems.append(f"{at}: {declared} receipts chose a declared terminal, "
                            f"{s.get('declared', 0)} rollouts declared one")  # fmt: skip
        if s["rows_valid"] == 0:
            problems.append(f"{at}: no valid row")
        problems += _image_problems(at, s)
        if s["engine_version"] != str(s["weight_version"]):
            problems.append(f"{at}: the engine serves {s['engine_version']!r}, not the push")
        if previous is not None:
            if s["weight_version"] <= previous["weight_version"]:
                problems.append(f"{at}: the weight version did not increase")
            sampled, pushed = s["sampled_version"], previous["weight_version"]
            if sampled != pushed and not (is_async and sampled is not None and sampled < pushed):
                problems.append(f"{at}: rows sampled by version {sampled}, not "
                                f"the one pushed after step {previous['step']}")  # fmt: skip
        if any(v != s["weight_version"] for v in s.get("gate_versions", [])):
            problems.append(f"{at}: gates at versions {s['gate_versions']} after the push")
        if s["staleness_max"] is not None and s["staleness_max"] > bound:
            problems.append(f"{at}: stale rows (staleness {s['staleness_max']} > {bound})")
        previous = s
    for gate in summary.get("gates", []):
        if gate["rollouts"] == 0:
            problems.append(f"gate {gate['url']} served no rollout")
    return problems


def _image_problems(at: str, step: dict[str, Any]) -> list[str]:
    """A vision-language step's images: every image sent is bound by its verified receipt
    and named by its row (unless a row was lost to a placeholder), and the trainer read
    back and verified at least one blob."""
    sent = step.get("images_sent", 0)
    if not sent:
        return []
    problems = []
    if step["rows_placeholder"] == 0 and not sent == step["images_bound"] == step["images"]:
        problems.append(f"{at}: {sent} images sent, {step['images_bound']} bound by the "
                        f"receipts, {step['images']} in the rows")  # fmt: skip
    if step["images"] and not step["image_blobs"]:
        problems.append(f"{at}: rows name images but no blob was read back")
    return problems


def _lost_note(train: dict[str, Any]) -> str:
    """`` (N lost with their gate: URL N, ...)`` when gates were lost, else nothing."""
    by_gate = train.get("receipts_lost_by_gate") or {}
    if not by_gate:
        return ""
    gates = ", ".join(f"{url} {n}" for url, n in by_gate.items())
    return f" ({train['receipts_lost']} lost with their gate, gate_unreachable: {gates})"


def _terminals_note(train: dict[str, Any]) -> str:
    """`` (terminals: declared N, response_id N, ...)``: how the receipts chose them."""
    terminals = train.get("terminals") or {}
    if not terminals:
        return ""
    return " (terminals: " + ", ".join(f"{k} {n}" for k, n in terminals.items()) + ")"


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
    fresh_note = " (rows sampled by the trained version)" if train.get("mode") == "async" else ""
    window = min(WINDOW, len(steps))
    overlap = ", the windows overlap" if len(steps) < 2 * WINDOW else ""
    console.print(
        f"reward (mean of {window} steps{overlap}): first {train['reward_first5']:.3f} → last "
        f"{train['reward_last5']:.3f} ([bold]{train['reward_gain']:+.3f}[/])\n"
        f"parity: max K3 {train['parity_k3_max']:.1e} "
        f"({'[green]≤' if ok else '[red]>'} {train['parity_k3_limit']:.0e}[/]) over "
        f"{len(steps)} steps{fresh_note}; receipts verified {train['receipts_verified']}/"
        f"{train['receipts_total']}{_lost_note(train)}{_terminals_note(train)}; "
        f"weight versions {train['weight_versions'][:1]}…"
        f"{train['weight_versions'][-1:]}\n"
        f"a step: {train['seconds_per_step_median']:.1f} s (median); {shares}\n"
        f"mode {train.get('mode', 'sync')}: staleness max {train['staleness_max']} "
        f"(bound {train.get('max_staleness', 0)}), stale tokens {train.get('tokens_stale', 0)}, "
        f"calls spanning versions {train.get('calls_spanning_versions', 0)}, dropped stale "
        f"{train.get('dropped_stale', 0)}, loop lag max "
        f"{train.get('loop_lag_ms_max', 0.0):.0f} ms, "
        f"{train.get('samples_per_s', 0.0):.2f} samples/s",
        highlight=False,
    )
    if train.get("images_sent"):
        console.print(
            f"images: {train['images_sent']} sent, {train['images_bound']} bound by the "
            f"verified receipts, {train['images']} in the trained rows; {train['image_blobs']} "
            "blobs of processed tensors read back from the sink and verified",
            highlight=False,
        )
