"""One step of reassembly on a 3-node Ray cluster on this machine, with a node killed in
the middle of it; prints what happened as one JSON line (the tests judge it).

Run as a script in its own process (Ray can be initialised once per process, and the
test session's Ray is a single-node one):

    .venv/bin/python tests/ray/multinode.py [--groups 24] [--kill-after 0]

Nodes (each its own raylet, all on 127.0.0.1): the head (2 CPUs: the driver's node,
TransferQueue's controller), a storage node (2 CPUs and the ``tq_storage`` resource:
TransferQueue's storage unit), a worker node (1 CPU). The pool: 3 reassembler actors of
0.5 CPU, ``SPREAD`` (one per node), each with its own `TQSink`. With ``--kill-after 0``
(the default) the worker node is killed the moment every group has been sent to its actor
(before any result is read): its actor still holds groups, and the replacement can only go
to the head or the storage node. With ``--kill-after N`` it is killed after N groups have
finished, which on a loaded machine may come after its actor has done all its work (a
reassembly takes milliseconds): then no death is seen at all.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TQ_NUM_THREADS", "2")

from tests.procs import descendants, process_table

STORAGE = "tq_storage"
_TITLES = {
    "controller": b"ray::TransferQueueController",
    "storage": b"ray::SimpleStorageUnit",
    "pool": b"ray::RolloutReassemblerActor",
}


def _placement(cluster: Any) -> dict[str, list[int]]:
    """Which node (index) each controller, storage unit and pool actor process runs on."""
    by_raylet = {node.raylet_pid: node.index for node in cluster.nodes}
    processes = process_table()
    where: dict[str, list[int]] = {role: [] for role in _TITLES}
    for ppid, title in processes.values():
        for role, prefix in _TITLES.items():
            if title.startswith(prefix):
                parent = ppid
                while parent in processes and parent not in by_raylet:
                    parent = processes[parent][0]
                if parent in by_raylet:  # not another cluster's on this machine
                    where[role].append(by_raylet[parent])
    return {role: sorted(nodes) for role, nodes in where.items()}


def _listening_not_on_loopback() -> tuple[int, list[str]]:
    """How many sockets this process tree listens on, and those not on loopback."""
    ours = descendants(os.getpid())
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    owned = [
        line.split()[3]
        for line in listing.splitlines()
        if {int(p) for p in re.findall(r"pid=(\d+)", line)} & ours
    ]
    loopback = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")
    return len(owned), [a for a in owned if not loopback.match(a)]


async def _step(cluster: Any, groups: int, kill_after: int) -> dict[str, Any]:
    from tests.ray.support import make_group
    from tokcap_core.rows import reassemble_group
    from tokcap_ray import ReassemblerPool
    from tokcap_tq import TQSink, TQSinkConfig

    sink = TQSink(TQSinkConfig(staging_partition="mn_staging", training_partition="mn_rows"))
    made = [
        make_group(f"mn{g:03d}", ["ok", "forest", "ok", "missing"], seed=g) for g in range(groups)
    ]
    await sink.put([c for _, staged in made for c in staged.values()])
    factory = functools.partial(TQSink.connect, sink.config)
    report: dict[str, Any] = {}
    results = []
    clock = time.monotonic()
    # One group at a time per actor: when the first group finishes, the worker node's
    # actor still holds at least two of its own (every slot gets at least three).
    pool = ReassemblerPool(3, factory, num_cpus=0.5, max_in_flight=groups, actor_concurrency=1)
    async with pool:
        report["pool_start_s"] = round(time.monotonic() - clock, 1)
        clock = time.monotonic()
        report["before"] = _placement(cluster)
        async with pool.as_completed([request for request, _ in made]) as finished:
            if kill_after == 0:
                while pool.stats["submitted"] < groups:  # every group sent to an actor
                    await anyio.sleep(0.001)
                report["in_flight_at_kill"] = groups
                report["killed"] = _kill_worker(cluster)
            async for finalized in finished:
                results.append(finalized)
                if len(results) == kill_after:
                    report["in_flight_at_kill"] = groups - len(results)
                    report["killed"] = _kill_worker(cluster)
        report["step_s"] = round(time.monotonic() - clock, 1)
        report["after"] = _placement(cluster)
        report["stats"] = dict(pool.stats)
    expected = {
        request.group_id: reassemble_group(request, staged, staging_cleared=True)
        for request, staged in made
    }
    by_group: dict[str, list[Any]] = {}
    for finalized in results:
        by_group.setdefault(finalized.group_id, []).append(finalized)
    report["groups"] = groups
    report["finished_once"] = sum(len(v) == 1 for v in by_group.values())
    report["finished_twice"] = sorted(g for g, v in by_group.items() if len(v) > 1)
    report["outcomes"] = sorted({f.outcome for f in results})
    mismatched = []
    for group_id, want in expected.items():
        (got,) = by_group.get(group_id, [None])
        if got is None or got.training_keys != want.finalized.training_keys:
            mismatched.append(group_id)
            continue
        if await sink.fetch(got.training_keys) != list(want.rows.values()):
            mismatched.append(group_id)
    report["rows_differ"] = mismatched
    report["rows"] = sum(len(f.training_keys) for f in results)
    report["staging_left"] = len(await sink.staged_keys())
    report["training_held"] = len(await sink.row_keys())
    await sink.clear_rows([k for f in results for k in f.training_keys])
    report["training_left"] = len(await sink.row_keys())
    return report


def _kill_worker(cluster: Any) -> int:
    """Kill the node that is neither the head nor the storage node (a crashed machine)."""
    victim = cluster.nodes[2]
    cluster.kill(victim)
    return int(victim.index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--kill-after", type=int, default=0)
    args = parser.parse_args()
    from tokcap_tq import NodeSpec, connect_tq, local_cluster

    nodes = [
        NodeSpec(num_cpus=2),
        NodeSpec(num_cpus=2, resources={STORAGE: 1}),
        NodeSpec(num_cpus=1),
    ]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mn-") as tmp, local_cluster(tmp, nodes) as cluster:
        cluster_s = time.monotonic() - started
        with connect_tq(cluster.address, storage_units=1, storage_resource=STORAGE) as tq:
            tq_s = time.monotonic() - started - cluster_s
            report = anyio.run(_step, cluster, args.groups, args.kill_after, backend="asyncio")
            report["cluster_start_s"], report["tq_start_s"] = round(cluster_s, 1), round(tq_s, 1)
            report["tq"] = {"nodes": tq.nodes, "owned": tq.owned}
            report["sockets"], report["not_loopback"] = _listening_not_on_loopback()
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
