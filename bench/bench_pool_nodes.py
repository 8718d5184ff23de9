"""Reassembler pool scaling over Ray nodes: rows/s with 1, 2, 3 worker nodes, on TQ.

    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 .venv/bin/python bench/bench_pool_nodes.py [--groups 64]

A loopback cluster on this machine (`tokcap_tq.local_cluster`): the head holds the driver,
TransferQueue's controller and its storage unit (``1 + 1`` CPUs, none left over), and
three worker nodes of 1 CPU each. For n = 1, 2, 3 a pool of n actors (1 CPU each,
``SPREAD``: one per worker node) reassembles the same ``--groups`` groups: each actor's
own `TQSink` fetches a group's staged rows from the storage unit, verifies and reassembles
them, publishes the rows and clears staging. The rows are staged again before every run
(not timed); n = 1, 2, 3 go in rotating order over ``--rounds`` rounds; the median per n
is reported, with its speed-up over n = 1.

Every node is a set of processes on the same machine: with ``os.cpu_count()`` cores, the
driver, the TQ controller, the storage unit and the n actors share them, so the speed-up
is bounded by the cores, not the nodes (the figure says how much of a second core the pool
gets, not what a real cluster would do).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TQ_NUM_THREADS", "2")

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parse_counts
from bench_pool import make_workload

from tokcap_core import StagedCall
from tokcap_ray import ReassemblerPool
from tokcap_tq import NodeSpec, TQSink, TQSinkConfig, connect_tq, local_cluster


async def _run(sink: TQSink, workers: int, requests: list[Any], staged: list[StagedCall]) -> float:
    await sink.put(staged)
    factory = functools.partial(TQSink.connect, sink.config)
    async with ReassemblerPool(workers, factory, num_cpus=1, max_in_flight=64) as pool:
        start = time.perf_counter()
        results = await pool.map(requests)
        elapsed = time.perf_counter() - start
    assert all(f.outcome == "published" for f in results)
    await sink.clear_rows([k for f in results for k in f.training_keys])
    return elapsed


async def bench(args: argparse.Namespace) -> None:
    requests, staged = make_workload(args.groups, args.rollouts, args.turns, args.delta)
    calls = list(staged.values())
    sink = TQSink(TQSinkConfig(staging_partition="pn_staging", training_partition="pn_rows"))
    tokens = sum(len(c.tokens) for c in calls)
    print(
        f"workload: {args.groups} groups x {args.rollouts} rollouts x {args.turns} calls, "
        f"{len(calls):,} staged calls, {tokens:,} staged tokens"
    )
    sizes = [1, 2, 3]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(args.rounds):
        order = sizes[r % 3 :] + sizes[: r % 3]
        for n in order:
            times[n].append(await _run(sink, n, requests, calls))
        print(f"  round {r}: " + ", ".join(f"{n} node(s) {times[n][-1]:.2f} s" for n in sizes))
    base = statistics.median(times[1])
    print(f"\n{'worker nodes':<14}{'median s':>10}{'groups/s':>10}{'vs 1 node':>11}")
    for n in sizes:
        t = statistics.median(times[n])
        print(f"{n:<14}{t:>10.2f}{args.groups / t:>10.1f}{base / t:>10.2f}x")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    args = parse_counts(__doc__, groups=64, rollouts=8, turns=4, delta=256, rounds=3)
    print(f"{os.cpu_count()} cores; load average at start {_load()}")
    head = NodeSpec(num_cpus=2, resources={"tq_storage": 1})  # TQ's controller and unit
    nodes = [head, *(NodeSpec(num_cpus=1) for _ in range(3))]
    with (
        tempfile.TemporaryDirectory(prefix="pn-") as tmp,
        local_cluster(tmp, nodes) as cluster,
        connect_tq(cluster.address, storage_units=1, storage_resource="tq_storage"),
    ):
        anyio.run(bench, args, backend="asyncio")
    print(f"load average at end {_load()}")


if __name__ == "__main__":
    main()
