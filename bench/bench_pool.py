"""Reassembler pool benchmark: rows/s and tokens/s through Ray actors vs the core in-process.

    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 .venv/bin/python bench/bench_pool.py [--groups 128]

Same input for every run: ``--groups`` groups of ``--rollouts`` simulated rollouts
(``--turns`` calls, up to ``--delta`` new tokens per call). Every run does the same
per-group work: one batched fetch of the staged rows, verify + reassemble (core),
publish N rows, clear staging.

1. in-process: `reassemble_group` around a `MemorySink` in this process (no Ray) --
   the baseline.
2. pool, reference sink: 1 and 2 workers; every actor reads and writes one shared
   ``SinkActor`` (all tokens cross two process boundaries per group; that actor is
   single-threaded, so it caps the scaling).
3. pool, local sink: 1 and 2 workers; each actor builds its own pre-filled
   `MemorySink` (a stand-in for a distributed store with fast local reads), so the
   actors' own CPU work is measured. Goal: 2 workers >= 1.8x of 1 worker on 2 cores.
Ray starts locally on 127.0.0.1 with ``--cpus`` logical CPUs (actors take 1 each).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import tempfile
import time
from typing import Any

# Loopback only and no ~/.ray/auth_token, as tokcap_tq.local_tq does (read when ray imports).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from _harness import parse_counts  # bench/ is on sys.path

from tokcap_core import MemorySink, ReassemblyRequest, StagedCall, assemble_receipt, verify_manifest
from tokcap_core.rows import on_chain_keys, reassemble_group
from tokcap_core.simulate import simulate_rollout
from tokcap_ray import ActorSink, ReassemblerPool, step_metrics

Workload = tuple[list[ReassemblyRequest], dict[str, StagedCall]]


def make_workload(groups: int, rollouts: int, turns: int, delta: int) -> Workload:
    """Deterministic groups of simulated rollouts (a function of its arguments only)."""
    requests, staged = [], {}
    for g in range(groups):
        receipts, ids = [], []
        for r in range(rollouts):
            rollout_id = f"g{g:04d}-r{r}"
            sim = simulate_rollout(
                rollout_id, seed=g * 1000 + r, turns=turns, max_delta=delta, routes=r % 2 == 0
            )
            receipts.append(assemble_receipt(verify_manifest(sim.manifest)))
            ids.append(rollout_id)
            staged.update(sim.staged)
        requests.append(
            ReassemblyRequest(
                group_id=f"g{g:04d}",
                rollout_ids=tuple(ids),
                receipts=tuple(receipts),
                rewards=tuple(float(r % 2) for r in range(rollouts)),
                max_seq_len=1 << 20,
            )
        )
    return requests, staged


async def prefilled_sink(shape: tuple[int, int, int, int]) -> MemorySink:
    """A `MemorySink` holding the workload's staged calls (built inside each actor)."""
    sink = MemorySink()
    _, staged = make_workload(*shape)
    await sink.put(list(staged.values()))
    return sink


async def in_process(workload: Workload) -> tuple[float, dict[str, float]]:
    requests, staged = workload
    sink = MemorySink()
    await sink.put(list(staged.values()))
    t0 = time.perf_counter()
    finalized = []
    for request in requests:
        calls = await sink.get(on_chain_keys(request))
        result = reassemble_group(
            request, {c.key: c for c in calls}, staging_cleared=request.clear_staging
        )
        await sink.publish(result.rows)
        await sink.clear(request.staging_keys)
        finalized.append(result.finalized)
    return time.perf_counter() - t0, step_metrics(finalized)


async def through_pool(workers: int, factory: Any, requests: list[ReassemblyRequest]) -> float:
    async with ReassemblerPool(workers, factory, num_cpus=1, max_in_flight=64) as pool:
        t0 = time.perf_counter()
        results = await pool.map(requests)
        elapsed = time.perf_counter() - t0
    assert all(f.outcome == "published" for f in results)
    return elapsed


async def run(args: argparse.Namespace) -> None:
    shape = (args.groups, args.rollouts, args.turns, args.delta)
    t0 = time.perf_counter()
    workload = make_workload(*shape)
    requests, staged = workload
    print(f"workload: {args.groups} groups x {args.rollouts} rollouts x {args.turns} calls "
          f"(<= {args.delta} new tokens/call), {len(staged):,} staged calls; "
          f"built in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    base_s, metrics = await in_process(workload)
    rows, tokens = metrics["rows/total"], metrics["tokens/total"]
    print(f"  {rows:,.0f} rows, {tokens:,.0f} tokens out per run\n")

    def line(name: str, seconds: float) -> None:
        print(f"  {name:<34} {rows / seconds:>9,.0f} rows/s {tokens / seconds:>12,.0f} tokens/s"
              f"   {base_s / seconds:>6.2f}x in-process")  # fmt: skip

    line("in-process (core + MemorySink)", base_s)
    timings: dict[str, float] = {}
    for workers in (1, 2):
        sink = ActorSink.start()
        await sink.put(list(staged.values()))
        timings[f"ref{workers}"] = await through_pool(workers, sink.factory(), requests)
        ray.kill(sink.handle, no_restart=True)
        line(f"pool, reference sink, {workers} worker(s)", timings[f"ref{workers}"])
    for workers in (1, 2):
        factory = functools.partial(prefilled_sink, shape)
        timings[f"local{workers}"] = await through_pool(workers, factory, requests)
        line(f"pool, local sink, {workers} worker(s)", timings[f"local{workers}"])
    print(f"\n  scaling 2/1 workers, reference sink: {timings['ref1'] / timings['ref2']:.2f}x")
    print(f"  scaling 2/1 workers, local sink    : {timings['local1'] / timings['local2']:.2f}x"
          "   (goal >= 1.8x on 2 cores)")  # fmt: skip


def main() -> None:
    args = parse_counts(
        __doc__, groups=128, rollouts=8, turns=4, delta=256, cpus=os.cpu_count() or 2
    )
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    temp_dir = tempfile.mkdtemp(prefix="tokcap-bench-", dir="/tmp")
    ray.init(
        num_cpus=args.cpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        asyncio.run(run(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
