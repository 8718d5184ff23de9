"""Closing a step's rollouts one by one vs in one batch (group commit), in the same run.

One in-process gate on the tiny model, its ledger persisted to a file (fsync at each close,
as a deployed gate does). Each round plays ``--rollouts`` short chats twice and closes the
first set the way a trainer did before (``ControlPlaneClient.close``, one request and one
fsync each, in turn) and the second with ``ControlPlaneClient.close_many`` (one request,
one fsync shared by all); the order alternates between rounds so drift hits both alike.
Printed: close seconds per step each way (median over rounds), fsyncs per step, and the
ratio ``one-by-one/batched close time: X.XXx``.

    .venv/bin/python bench/bench_close.py [--rollouts 32] [--rounds 6]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import CPU_ENGINE_ARGS, parse_counts, set_engine_env  # bench/ is on sys.path

set_engine_env()

import anyio  # noqa: E402
import openai  # noqa: E402

from tokcap.tiny import build_tiny_model  # noqa: E402
from tokcap_core import CaptureConfig  # noqa: E402
from tokcap_vllm import (  # noqa: E402
    ControlPlaneClient,
    Gate,
    GateConfig,
    InProcessServer,
    RolloutClose,
)

TOKEN = "bench-close-token"
VLLM_ARGS = [*CPU_ENGINE_ARGS, "--max-model-len", "1024", "--max-num-seqs", "64"]


async def _play(server: InProcessServer, rids: list[str]) -> None:
    async def one(rid: str) -> None:
        async with openai.AsyncOpenAI(
            base_url=server.rollout_url(rid), api_key="x", max_retries=0
        ) as c:
            await c.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": f"count {rid}"}],
                max_tokens=4,
            )

    async with anyio.create_task_group() as tg:
        for rid in rids:
            tg.start_soon(one, rid)


async def _round(
    server: InProcessServer, index: int, rollouts: int
) -> tuple[float, float, int, int]:
    """Seconds to close one step's rollouts one by one and batched, and the fsyncs of each."""
    file = server.gate.ledger_file
    assert file is not None
    single = [f"b{index}-one-{i}" for i in range(rollouts)]
    batched = [f"b{index}-many-{i}" for i in range(rollouts)]
    await _play(server, single + batched)
    async with ControlPlaneClient(server.base_url, TOKEN) as cp:

        async def one_by_one() -> tuple[float, int]:
            syncs, t0 = file.syncs, time.perf_counter()
            for rid in single:
                await cp.close(rid, reward=1.0)
            return time.perf_counter() - t0, file.syncs - syncs

        async def in_batch() -> tuple[float, int]:
            syncs, t0 = file.syncs, time.perf_counter()
            results = await cp.close_many([RolloutClose(rollout_id=r, reward=1.0) for r in batched])
            assert all(r.ok for r in results)
            return time.perf_counter() - t0, file.syncs - syncs

        if index % 2:
            (many_s, many_f), (one_s, one_f) = await in_batch(), await one_by_one()
        else:
            (one_s, one_f), (many_s, many_f) = await one_by_one(), await in_batch()
        await cp.release_many(single + batched)
    return one_s, many_s, one_f, many_f


def main() -> None:
    args = parse_counts(__doc__, sys.argv[1:], rollouts=32, rounds=6)
    model = build_tiny_model(Path(tempfile.gettempdir()) / "tokcap-tiny" / "dense", kind="dense")
    with tempfile.TemporaryDirectory() as folder:
        config = GateConfig(
            capture=CaptureConfig(control_token=TOKEN), ledger_path=f"{folder}/ledger.jsonl"
        )
        server = InProcessServer(str(model), gate=Gate(config), vllm_args=VLLM_ARGS).start()
        try:
            anyio.run(_round, server, -1, 4)  # warm-up
            rounds = [anyio.run(_round, server, i, args.rollouts) for i in range(args.rounds)]
        finally:
            server.stop()
    one = statistics.median(r[0] for r in rounds)
    many = statistics.median(r[1] for r in rounds)
    print(f"rollouts per step: {args.rollouts}, rounds: {args.rounds}")
    print(f"close per step, one by one: {one * 1e3:.1f} ms ({rounds[0][2]} fsyncs)")
    print(f"close per step, batched:    {many * 1e3:.1f} ms ({rounds[0][3]} fsync)")
    print(f"one-by-one/batched close time: {one / many:.2f}x")


if __name__ == "__main__":
    main()
