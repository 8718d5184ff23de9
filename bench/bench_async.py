"""Synchronous against asynchronous ``tokcap train`` in one run: same task, same seed.

Runs ``tokcap train`` twice (each in its own process, so each starts its own Ray,
TransferQueue and vLLM engine, as a user runs it): lock-step, then ``--async
--max-staleness K``. From each run's ``summary.json`` it prints

- ``async/sync samples per second: X.XXx``: rollouts trained per second of the whole
  train stage (its wall clock, as ``tokcap train`` prints it), async over sync; the rate
  over the steps' own seconds is printed too (it leaves out async's drain: the groups
  still generating when the last step has trained);
- both reward curves (mean reward per step) and each run's first-5/last-5 gain;
- tokcap's share of the blocking work in a step (`tokcap.loop.tokcap_share`: sync, the
  collecting left once the last answer came; async, the train pump waiting on a group
  that has played but is not collected yet, ``collect_wait``) and, for async, what the
  train pump waited on in all (``wait``) and trained;
- staleness actually trained, calls spanning a push, groups dropped stale, loop lag.

On a 2-core box the engine, the trainer, Ray and TransferQueue share two cores: the async
gain is bounded by that. Per run the bench prints where the time and the CPU go (each step
records them, `tokcap.loop._meters`): the share of the wall time the engine had a call in
flight and how many, the CPU seconds per trained sample (engine core, driver: trainer,
gate, API server and pumps; Ray and TransferQueue), and the CPU-seconds per wall second
against the box's cores. If sync already keeps the cores busy, overlapping cannot gain
more than the idle CPU left: the async/sync ratio is bounded by
``(sync CPU per sample / async CPU per sample) x (async CPU busy / sync CPU busy)``.

Each run also prints the shapes it played (calls per rollout, tokens per trained row) and
the engine's calls in flight step by step. ``--task long-tail`` plays the long-tailed agent
task (`tokcap.loop.long_tail_shape`) in both runs: where a lock-step loop waits for its
stragglers with a nearly empty engine batch.

Run: ``.venv/bin/python bench/bench_async.py [--steps 40] [--max-staleness 2] [--seed 0]
[--task agent|digits|long-tail] [--out DIR]``; ``--summaries DIR`` prints the figures of
runs kept with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STAGES = ("generate", "capture_verify", "reassemble", "wait", "collect_wait", "train", "push")


def train(out: Path, steps: int, seed: int, extra: list[str]) -> dict[str, Any]:
    """One ``tokcap train`` run; its summary. A run that left no summary (on a loaded box
    Ray's start can time out) is tried once more."""
    command = [sys.executable, "-m", "tokcap", "train", "--steps", str(steps), "--seed", str(seed)]
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    for _ in range(2):
        proc = subprocess.run([*command, *extra, "--out", str(out)], env=env, check=False)
        if (out / "summary.json").exists():
            break
    if proc.returncode not in (0, 1):  # 1: an invariant failed, still measured
        raise SystemExit(f"tokcap train {' '.join(extra)} exited {proc.returncode}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def describe(name: str, summary: dict[str, Any]) -> float:
    """Print one run's figures; its samples per second."""
    from tokcap.loop import tokcap_share

    t = summary["train"]
    steps = t["steps"]
    measured = steps[1:] or steps
    total = statistics.mean(s["seconds"]["total"] for s in measured)
    share = statistics.mean(tokcap_share(s["seconds"]) for s in measured)
    print(f"\n== {name}: {len(steps)} steps, {t['samples_per_s']:.2f} samples/s, "
          f"{total:.2f} s a step (mean after step 0)")  # fmt: skip
    print(f"reward: first 5 {t['reward_first5']:.3f} -> last 5 {t['reward_last5']:.3f} "
          f"({t['reward_gain']:+.3f})")  # fmt: skip
    print("rewards: " + " ".join(f"{s['reward_mean']:.2f}" for s in steps))
    parts = []
    for stage in STAGES:
        values = [s["seconds"][stage] for s in measured if stage in s["seconds"]]
        if values:
            parts.append(f"{stage} {statistics.mean(values):.2f}")
    print("seconds a step: " + ", ".join(parts) + " (async: generate and collect are summed "
          "over the step's groups and overlap)")  # fmt: skip
    print(f"tokcap share of a step: {share * 100:.1f} %")
    print(load_line(load_figures(t["steps"], summary["config"])))
    print(played_line(steps))
    occupancy = [s["seconds"].get("in_flight") for s in steps]
    if all(v is not None for v in occupancy):
        print("engine calls in flight when busy, step by step: "
              + " ".join(f"{v:.1f}" for v in occupancy))  # fmt: skip
    print(f"staleness max {t['staleness_max']}, stale tokens {t.get('tokens_stale', 0)}, "
          f"calls spanning versions {t.get('calls_spanning_versions', 0)}, dropped stale "
          f"{t.get('dropped_stale', 0)}, loop lag max {t.get('loop_lag_ms_max', 0.0):.0f} ms, "
          f"receipts {t['receipts_verified']}/{t['receipts_total']}")  # fmt: skip
    return float(t["samples_per_s"])


def played_line(steps: list[dict[str, Any]]) -> str:
    """The rollout shapes a run actually played: calls per rollout, tokens per trained row."""
    calls: dict[int, int] = {}
    for s in steps:
        for n, count in s.get("calls_per_rollout", {}).items():
            calls[int(n)] = calls.get(int(n), 0) + count
    tokens = sorted(t for s in steps for t in s.get("row_tokens", []))
    if not calls or not tokens:
        return "played: not recorded"
    total = sum(calls.values())
    shape = ", ".join(f"{n}: {calls[n]} ({calls[n] / total:.0%})" for n in sorted(calls))
    p50, p90 = tokens[len(tokens) // 2], tokens[min(len(tokens) - 1, len(tokens) * 9 // 10)]
    return (
        f"played: calls per rollout {shape}; tokens per row median {p50}, p90 {p90}, "
        f"max {tokens[-1]}"
    )


def load_figures(steps: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, float]:
    """What bounds a run (steps after the first): ``busy`` (share of the wall time the engine
    had a call in flight), ``in_flight`` (calls in flight when busy), CPU seconds per trained
    sample (``cpu``: the run's whole process tree; ``engine``, ``driver``, ``ray``) and
    ``cpu_busy`` (CPU seconds per wall second); empty if the steps did not record them."""
    measured = steps[1:] or steps
    wall = sum(s["seconds"]["total"] for s in measured)
    got = [s["seconds"] for s in measured if "cpu" in s["seconds"]]
    if not got or not wall:
        return {}
    samples = len(measured) * config["groups"] * config["rollouts"]
    # the stamps' windows tile the run; a step's own total leaves out between-step work
    wall = sum(s.get("window", s["total"]) for s in got)
    busy = sum(s.get("engine_busy", 0.0) for s in got)
    area = sum(s.get("engine_busy", 0.0) * s.get("in_flight", 0.0) for s in got)
    cpu = sum(s["cpu"] for s in got)
    engine = sum(s.get("cpu_engine", 0.0) for s in got)
    driver = sum(s.get("cpu_driver", 0.0) for s in got)
    return {
        "busy": busy / wall,
        "in_flight": area / busy if busy else 0.0,
        "cpu": cpu / samples,
        "engine": engine / samples,
        "driver": driver / samples,
        "ray": (cpu - engine - driver) / samples,
        "cpu_busy": cpu / wall,
    }


def load_line(f: dict[str, float]) -> str:
    if not f:
        return "load: not measured"
    return (
        f"engine busy {f['busy']:.0%} of the wall time, {f['in_flight']:.1f} calls in flight "
        f"when busy; CPU {f['cpu']:.3f} s a sample (engine core {f['engine']:.3f}, driver "
        f"{f['driver']:.3f}, Ray + TQ + rest {f['ray']:.3f}); CPU busy {f['cpu_busy']:.2f} "
        f"of {os.cpu_count()} cores"
    )


def wall_rate(summary: dict[str, Any]) -> float:
    """Samples trained per second of the run's whole train stage (its wall clock: step 0,
    and for async the pipeline's fill and its drain at the end, included)."""
    config, timings = summary["config"], summary["timings_s"]
    wall = next(v for k, v in timings.items() if k.startswith("train ("))
    return float(len(summary["train"]["steps"]) * config["groups"] * config["rollouts"] / wall)


def bounds(sync: dict[str, Any], asyn: dict[str, Any]) -> None:
    """What bounds async over sync, in figures (see the module docstring)."""
    fs = load_figures(sync["train"]["steps"], sync["config"])
    fa = load_figures(asyn["train"]["steps"], asyn["config"])
    if not (fs and fa):
        return
    measured = sync["train"]["steps"][1:] or sync["train"]["steps"]
    step = statistics.mean(s["seconds"]["total"] for s in measured)
    generate = statistics.mean(s["seconds"]["generate"] for s in measured)
    # perfect overlap hides everything but generating: at the same batch, sync's step over
    # its generate stage is the most async can gain, unless a bigger batch generates faster
    print(
        f"overlap bound: sync generates {generate:.2f} s of its {step:.2f} s step "
        f"({generate / step:.0%}): with every other stage hidden, at most {step / generate:.2f}x"
    )
    rate_s = sync["config"]["groups"] * sync["config"]["rollouts"] * len(measured)
    busy_s = sum(s["seconds"].get("engine_busy", 0.0) for s in measured)
    measured_a = asyn["train"]["steps"][1:] or asyn["train"]["steps"]
    rate_a = asyn["config"]["groups"] * asyn["config"]["rollouts"] * len(measured_a)
    busy_a = sum(s["seconds"].get("engine_busy", 0.0) for s in measured_a)
    if busy_s and busy_a:
        print(
            f"batch: {rate_s / busy_s:.2f} samples per engine-busy second at "
            f"{fs['in_flight']:.1f} calls in flight (sync), {rate_a / busy_a:.2f} at "
            f"{fa['in_flight']:.1f} (async)"
        )
    cores = os.cpu_count() or 1
    # samples/s = CPU busy / CPU per sample: what async gains is the idle CPU sync left
    # (cores / sync's CPU busy) times how much cheaper (or dearer) an async sample is
    print(
        f"CPU bound: sync keeps {fs['cpu_busy']:.2f} of {cores} cores busy, async "
        f"{fa['cpu_busy']:.2f}; CPU per sample async/sync {fa['cpu'] / fs['cpu']:.2f}; "
        f"the most async could gain with every core busy: "
        f"{cores / fs['cpu_busy'] * fs['cpu'] / fa['cpu']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument(
        "--task", choices=("agent", "digits", "long-tail"), default="agent",
        help="the task both runs play (long-tail: where asynchronous should pay)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="keep both runs here (default: a temp dir)")
    parser.add_argument(
        "--summaries", type=Path, help="print the figures of runs kept with --out (no new run)"
    )
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    if args.summaries is None:
        print(f"task: {args.task}")
    if args.summaries is not None:
        sync, asyn = (
            json.loads((args.summaries / name / "summary.json").read_text())
            for name in ("sync", "async")
        )
    else:
        with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
            where = args.out or Path(tmp)
            task = ["--task", args.task]
            sync = train(where / "sync", args.steps, args.seed, task)
            asyn = train(
                where / "async",
                args.steps,
                args.seed,
                [*task, "--async", "--max-staleness", str(args.max_staleness)],
            )
    sync_steps = describe("sync", sync)
    async_steps = describe(f"async (K={asyn['train']['max_staleness']})", asyn)
    sync_wall, async_wall = wall_rate(sync), wall_rate(asyn)
    print(
        f"\nsamples per second over the steps' own seconds: sync {sync_steps:.2f}, async "
        f"{async_steps:.2f} ({async_steps / sync_steps:.2f}x; async's steps leave out the "
        "pipeline's drain at the end)"
    )
    print(
        f"samples per second over the whole train stage: sync {sync_wall:.2f}, async "
        f"{async_wall:.2f} (async's fill and drain included)"
    )
    print(f"async/sync samples per second: {async_wall / sync_wall:.2f}x")
    bounds(sync, asyn)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
