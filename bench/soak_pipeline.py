"""Soak: 10,000 rollouts streamed through gate -> TQSink -> Ray pool -> clears, memory traced.

The demo's services on one machine (built as `tokcap.compose` builds them): vLLM's OpenAI server
with the gate (tiny model, the demo's vLLM options, ledger persisted to a file that
compacts as rollouts are released) staging into a `TQSink` on a loopback Ray +
TransferQueue, and a `ReassemblerPool` of ``--workers`` actors. A harness (the real
``openai`` client) plays groups of ``--group-size`` rollouts of ``--turns`` short calls,
``--concurrency`` rollouts at a time; finished groups stream to the trainer, which takes
them ``--batch-groups`` at a time through `tokcap.compose` (as the example trainer does):
``collect``
(close with reward and response-id witness, verified receipts, the pool, the policy, rows
and advantages) then ``finish`` (clear the rows, release the rollouts), and then forgets
the batch's groups on the pool (`ReassemblerPool.forget`: the example's ``finish`` does
not, and a long-running trainer must, or the pool keeps one progress record per group).
The harness keeps running while a batch is collected; a bounded stream between them
holds it back when the trainer falls behind.

Every batch is checked: every rollout's receipt verifies, every group is accepted, one
row per rollout with its reward. At ``--checkpoints`` points (and at the start, after a
warm-up batch) the run records the resident memory (VmRSS) of this process (gate, API
server, harness, trainer) and of each process it started, by role (vLLM's engine core,
Ray's GCS and raylet, TransferQueue's controller and storage unit, the pool's actors),
plus what is held: keys in both TransferQueue partitions, rollouts held by the gate
(``Gate.rollouts()``, open and closed records of its book), the ledger file's size.
At the end nothing may be held: 0 staged keys, 0 row keys, 0 rollouts on the gate.

    .venv/bin/python bench/soak_pipeline.py [--rollouts 10000] [--group-size 4]
        [--batch-groups 25] [--turns 2] [--max-tokens 4] [--concurrency 64] [--workers 2]
        [--checkpoints 10]
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import parse_counts, set_engine_env  # bench/ is on sys.path

set_engine_env(RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")

from _procmem import memory_by_role  # noqa: E402  (bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "soak-" + os.urandom(8).hex()
WARM = 10**6  # warm-up groups are numbered from here
ROLES = (
    "driver",
    "engine core",
    "ray::TransferQueueController",
    "ray::TransferQueueStorageUnit",
    "ray::RolloutReassemblerActor",
    "ray::ProgressActor",
    "raylet",
    "gcs",
)


@dataclass(slots=True)
class Totals:
    """What the run did and found."""

    rollouts: int = 0
    calls: int = 0
    batches: int = 0
    harness_errors: list[str] = field(default_factory=list)
    receipts_not_ok: int = 0
    groups_not_accepted: int = 0
    row_mismatches: int = 0
    progress_records_forgotten: int = 0
    checkpoints: list[dict[str, Any]] = field(default_factory=list)


async def _held(server: Any, sink: Any, ledger_path: Path) -> dict[str, Any]:
    """What the run holds now: TQ keys, the gate's rollouts and records, the ledger file."""
    import anyio

    gate = server.gate

    async def on_gate() -> dict[str, int]:
        open_held, closed_held = gate.book.counts()
        return {
            "gate_rollouts": len(gate.rollouts()),
            "gate_open_records": len(gate.book.records()),
            "gate_open_with_entries": open_held,
            "gate_closed_ledgers": closed_held,
        }

    held: dict[str, Any] = dict(await anyio.to_thread.run_sync(lambda: server.call(on_gate)))
    held["tq_staged_keys"] = len(await sink.staged_keys())
    held["tq_row_keys"] = len(await sink.row_keys())
    held["ledger_file_kib"] = (
        round(ledger_path.stat().st_size / 1024) if ledger_path.exists() else 0
    )
    return held


async def _checkpoint(
    label: str, totals: Totals, started: float, server: Any, sink: Any, ledger: Path
) -> None:
    gc.collect()
    point = {
        "label": label,
        "rollouts": totals.rollouts,
        "elapsed_s": time.perf_counter() - started,
        "load": Path("/proc/loadavg").read_text().split()[0],
        "rss_mib": memory_by_role(),
        "held": await _held(server, sink, ledger),
    }
    totals.checkpoints.append(point)
    rss = point["rss_mib"]
    print(
        f"[soak] checkpoint {label}: {totals.rollouts} rollouts, "
        f"{point['elapsed_s']:.0f} s, load {point['load']}; RSS MiB "
        + ", ".join(f"{k} {v:.0f}" for k, v in rss.items())
        + "; held "
        + ", ".join(f"{k} {v:g}" for k, v in point["held"].items()),
        flush=True,
    )


async def _play_group(
    server: Any, http: Any, g: int, args: argparse.Namespace, totals: Totals
) -> list[Any] | None:
    """One group: ``group_size`` rollouts of one task, ``turns`` calls each, concurrently."""
    import anyio
    import openai

    from tokcap.compose import Finished

    finished: list[Any] = []
    failed = False

    async def rollout(i: int) -> None:
        nonlocal failed
        rid = f"soak-g{g:05d}-r{i}"
        client = openai.AsyncOpenAI(
            base_url=server.rollout_url(rid), api_key="x", max_retries=0, http_client=http
        )
        messages: list[Any] = [{"role": "user", "content": f"task {g}: count the files"}]
        response_id = None
        for turn in range(args.turns):
            try:
                r = await client.chat.completions.create(
                    model=server.model,
                    messages=messages,
                    max_tokens=args.max_tokens,
                    temperature=1.0,  # no seed: vLLM 0.32 CPU dies on a seeded chunked prefill
                )
            except Exception as e:  # counted; the rollout is then left out of its group
                totals.harness_errors.append(f"{rid}/{turn}: {type(e).__name__}: {e}"[:200])
                failed = True
                return
            totals.calls += 1
            response_id = r.id
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"observation {turn}: 3 files"},
            ]
        reward = round(random.Random(g * 1000 + i).uniform(-1, 1), 3)
        finished.append(
            Finished(
                rollout_id=rid, group_id=f"soak-g{g:05d}", reward=reward, response_id=response_id
            )
        )

    async with anyio.create_task_group() as tg:
        for i in range(args.group_size):
            tg.start_soon(rollout, i)
    return None if failed else sorted(finished, key=lambda f: f.rollout_id)


async def _train(
    batch: list[Any],
    control: Any,
    pool: Any,
    sink: Any,
    capture: Any,
    totals: Totals,
) -> None:
    """One batch through the example trainer, checked, then the pool's records forgotten."""
    from tokcap.compose import collect, finish
    from tokcap_core import Accept

    out = await collect(control, pool, sink, batch, capture)
    totals.receipts_not_ok += sum(1 for r in out.receipts.values() if not r.ok)
    totals.groups_not_accepted += sum(
        1 for d in out.decisions.values() if not isinstance(d, Accept)
    )
    reward_of = {f.rollout_id: f.reward for f in batch}
    rows_of = {row.rollout_id: row for row in out.rows}
    totals.row_mismatches += sum(
        1
        for rid, reward in reward_of.items()
        if rid not in rows_of
        or rows_of[rid].sample_mask != 1
        or not math.isclose(rows_of[rid].reward or 0.0, reward)
    ) + max(0, len(out.rows) - len(reward_of))
    await finish(control, sink, out)
    groups = sorted({f.group_id for f in batch})
    totals.progress_records_forgotten += await pool.forget(groups)
    totals.rollouts += len(batch)
    totals.batches += 1


async def _drive(
    server: Any, sink: Any, capture: Any, args: argparse.Namespace, ledger: Path
) -> Totals:
    import anyio
    import httpx

    from tokcap_ray import ReassemblerPool
    from tokcap_tq import TQSink
    from tokcap_vllm import ControlPlaneClient

    totals = Totals()
    factory = functools.partial(TQSink.connect, sink.config)
    pool = ReassemblerPool(args.workers, factory, num_cpus=1.0)
    groups_total = math.ceil(args.rollouts / args.group_size)
    per_checkpoint = max(1, args.rollouts // args.checkpoints)
    limits = httpx.Limits(max_connections=args.concurrency + 32)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(anyio.to_thread.run_sync, server.wait_ready))
            await pool.start()
        async with (
            httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http,
            ControlPlaneClient(server.base_url, TOKEN, timeout_s=300, max_concurrency=32) as cp,
        ):
            warm = [await _play_group(server, http, WARM + g, args, totals) for g in range(2)]
            await _train([f for grp in warm if grp for f in grp], cp, pool, sink, capture, totals)
            totals.rollouts = totals.calls = totals.batches = 0
            started = time.perf_counter()
            await _checkpoint("start", totals, started, server, sink, ledger)
            send, receive = anyio.create_memory_object_stream[list[Any]](args.batch_groups * 2)
            limiter = anyio.Semaphore(max(1, args.concurrency // args.group_size))

            async def produce() -> None:
                async def group(g: int) -> None:
                    try:  # holds its place until the trainer took it: backpressure
                        finished = await _play_group(server, http, g, args, totals)
                        if finished is not None:
                            await send.send(finished)
                    finally:
                        limiter.release()

                async with send, anyio.create_task_group() as players:
                    for g in range(groups_total):
                        await limiter.acquire()
                        players.start_soon(group, g)

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                pending: list[list[Any]] = []
                next_checkpoint = per_checkpoint
                async with receive:
                    async for finished in receive:
                        pending.append(finished)
                        if len(pending) < args.batch_groups:
                            continue
                        await _train(
                            [f for grp in pending for f in grp], cp, pool, sink, capture, totals
                        )
                        pending.clear()
                        _progress(totals, started)
                        if totals.rollouts >= next_checkpoint:
                            await _checkpoint(
                                f"{totals.rollouts}", totals, started, server, sink, ledger
                            )
                            next_checkpoint += per_checkpoint
                    if pending:
                        await _train(
                            [f for grp in pending for f in grp], cp, pool, sink, capture, totals
                        )
            await _checkpoint("end", totals, started, server, sink, ledger)
    finally:
        with anyio.CancelScope(shield=True):
            pool.close()
    return totals


def _progress(totals: Totals, started: float) -> None:
    elapsed = time.perf_counter() - started
    print(
        f"[soak] {totals.rollouts} rollouts ({totals.calls} calls, {totals.batches} batches) in "
        f"{elapsed:.0f} s, {totals.rollouts / elapsed:.1f} rollouts/s; "
        f"errors {len(totals.harness_errors)}",
        flush=True,
    )


def main() -> None:
    args = parse_counts(
        __doc__,
        rollouts=10_000,
        group_size=4,
        batch_groups=25,
        turns=2,
        max_tokens=4,
        concurrency=64,
        workers=2,
        checkpoints=10,
    )
    sys.path.insert(0, str(ROOT / "src"))
    import anyio

    from tokcap.demo import QWEN_VLLM_ARGS
    from tokcap.tiny import build_tiny_model
    from tokcap_core import CaptureConfig
    from tokcap_tq import TQSink, TQSinkConfig, local_tq
    from tokcap_vllm import Gate, GateConfig, InProcessServer

    model = build_tiny_model(
        Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense"
    )
    capture = CaptureConfig(
        segments="terminal", max_seq_len=4096, min_valid_fraction=0.5, control_token=TOKEN
    )
    sink = TQSink(TQSinkConfig(staging_partition="soak_staging", training_partition="soak_rows"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        ledger = Path(tmp) / "ledger.jsonl"
        gate = Gate(
            GateConfig(parent_commit_timeout_s=600, capture=capture, ledger_path=str(ledger)),
            sink=sink,
        )
        server = InProcessServer(str(model), gate=gate, vllm_args=QWEN_VLLM_ARGS)
        print("[soak] starting Ray + TransferQueue, then vLLM + gate ...", flush=True)
        with local_tq(tmp, storage_units=1, extra_cpus=args.workers):
            server.launch()  # one at a time: Ray's start-up times out on a loaded box
            try:  # the engine and its sink writes stop before TransferQueue does
                totals = anyio.run(_drive, server, sink, capture, args, ledger)
            finally:
                server.stop(timeout=180)
    _report(args, totals, time.perf_counter() - started)


def _report(args: argparse.Namespace, totals: Totals, wall: float) -> None:
    points = totals.checkpoints
    print(
        f"\n## soak_pipeline: {totals.rollouts} rollouts ({totals.calls} calls) in "
        f"{totals.batches} batches of {args.batch_groups} groups x {args.group_size}, "
        f"{args.turns} turns x {args.max_tokens} tokens, concurrency {args.concurrency}, "
        f"{args.workers} pool workers; {wall:.0f} s wall in all"
    )
    roles = [r for r in ROLES if any(r in p["rss_mib"] for p in points)]
    roles += sorted({r for p in points for r in p["rss_mib"]} - set(roles))
    print("\n| checkpoint | rollouts | s | load | " + " | ".join(roles) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(roles))
    for p in points:
        cells = [f"{p['rss_mib'].get(r, float('nan')):.0f}" for r in roles]
        print(
            f"| {p['label']} | {p['rollouts']} | {p['elapsed_s']:.0f} | {p['load']} | "
            + " | ".join(cells)
            + " |"
        )
    held_keys = list(points[-1]["held"])
    print("\n| checkpoint | " + " | ".join(held_keys) + " |")
    print("|---|" + "---:|" * len(held_keys))
    for p in points:
        print(f"| {p['label']} | " + " | ".join(f"{p['held'][k]:g}" for k in held_keys) + " |")
    first, middle, last = points[0], points[len(points) // 2], points[-1]
    print("\nRSS MiB start / middle / end (change start -> end):")
    for r in roles:
        a, b, c = (p["rss_mib"].get(r, float("nan")) for p in (first, middle, last))
        print(f"  {r}: {a:.0f} / {b:.0f} / {c:.0f} ({c - a:+.0f})")
    leftovers = {k: v for k, v in last["held"].items() if k != "ledger_file_kib" and v}
    print(
        f"\nharness errors {len(totals.harness_errors)}, receipts not verified "
        f"{totals.receipts_not_ok}, groups not accepted {totals.groups_not_accepted}, row "
        f"mismatches {totals.row_mismatches}, pool progress records forgotten "
        f"{totals.progress_records_forgotten}; held at the end: {leftovers or 'nothing'}"
    )
    for e in totals.harness_errors[:5]:
        print(f"  error: {e}")
    ok = not (
        totals.harness_errors
        or totals.receipts_not_ok
        or totals.groups_not_accepted
        or totals.row_mismatches
        or leftovers
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
