"""A trainer driving gates someone already started (``tokcap-vllm serve --tokcap-sink tq``).

It joins the Ray cluster, starts TransferQueue there (the gates wait for it, then stage
every call into it), opens each rollout on one gate of the fleet, lets a toy harness play
one chat per rollout through that gate's base URL, then takes custody: close, verified
receipts from every gate, the staged rows read back from TransferQueue in this process.
It prints one JSON line: per gate, and whether every row's ids are the engine's own (the
gates must run with ``--tokcap-return-token-ids`` for that check).

    python examples/fleet_trainer.py --ray-address HOST:PORT --gate URL --gate URL

The control token comes from ``TOKCAP_CONTROL_TOKEN`` (the gates' token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import time
from typing import Any

import anyio
import openai

from tokcap_core import reassemble
from tokcap_tq import TQSink, TQSinkConfig, connect_tq
from tokcap_vllm import GateFleet, RolloutClose, wait_for_gates


async def harness(base_url: str, prompt: str) -> list[int]:
    """A black box speaking the OpenAI API: one chat; returns the engine's ids if given."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=2)
    try:
        model = (await client.models.list()).data[0].id
        answer: Any = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=16,
            extra_body={"return_token_ids": True},
        )
        prompt_ids = getattr(answer, "prompt_token_ids", None) or []
        return [*prompt_ids, *(getattr(answer.choices[0], "token_ids", None) or [])]
    finally:
        await client.close()


async def train_step(fleet: GateFleet, sink: TQSink, rollouts: int, run_id: str) -> dict[str, Any]:
    """One step over the fleet: play, close, receipts, rows; everything freed at the end.

    Rollout ids start with ``run_id``: ids are the trainer's, and two trainers on the same
    gates keep theirs apart (an id another active trainer holds is refused)."""
    rids = [f"{run_id}-step0-r{i}" for i in range(rollouts)]
    engine_ids = {}
    for i, rid in enumerate(rids):
        engine_ids[rid] = await harness(await fleet.open(rid), f"count to {i}")
    closes = [RolloutClose(rollout_id=rid, reward=1.0) for rid in rids]
    heads = {r.rollout_id: r.head_or_raise() for r in await fleet.close_many(closes)}
    receipts = await fleet.fetch_receipts(rids, expected_heads=heads)
    equal, rows = 0, 0
    for receipt in receipts:
        if receipt.status == "verified":
            staged = await sink.get(list(receipt.sink_keys))
            for row in reassemble(receipt, staged, max_seq_len=32768):
                rows += 1
                equal += list(row.input_ids) == engine_ids[receipt.rollout_id]
        await sink.clear(list(receipt.sink_keys))
    await sink.clear(fleet.orphaned_keys(await sink.staged_keys()))
    await fleet.release_many(rids)
    return {
        "rollouts": len(rids),
        "verified": sum(r.status == "verified" for r in receipts),
        "rows": rows,
        "rows_equal_engine_ids": equal,
        "gates": [
            {"url": g.url, "alive": g.alive, "opened": g.opened, "released": g.released}
            for g in fleet.report()
        ],
    }


async def main_async(args: argparse.Namespace, token: str, deadline: float) -> dict[str, Any]:
    # the gates serve once attached to the TransferQueue this process has just started
    await wait_for_gates(args.gate, token, timeout_s=max(deadline - time.monotonic(), 60.0))
    sink = TQSink(TQSinkConfig())
    async with GateFleet(args.gate, token) as fleet:
        return await train_step(fleet, sink, args.rollouts, args.run_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--gate", action="append", required=True, help="a gate's URL (repeat)")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument(
        "--run-id", default=f"run-{secrets.token_hex(4)}", help="the rollout ids' prefix"
    )
    parser.add_argument(
        "--wait-s", type=float, default=600.0, help="for the head, TransferQueue and the gates"
    )
    args = parser.parse_args()
    token = os.environ["TOKCAP_CONTROL_TOKEN"]
    with contextlib.ExitStack() as stack:
        deadline = time.monotonic() + args.wait_s
        host, _, port = args.ray_address.rpartition(":")
        while True:  # the Ray head may still be starting (ray.init would wait for minutes)
            try:
                socket.create_connection((host, int(port)), timeout=2.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
        # tq.init starts TransferQueue's actors as new Ray workers: on a machine busy starting
        # the gates' engines that took over two minutes (connect_tq's default limit).
        remaining = max(deadline - time.monotonic(), 60.0)
        stack.enter_context(connect_tq(args.ray_address, init_timeout_s=remaining))
        print(json.dumps(anyio.run(main_async, args, token, deadline)), flush=True)


if __name__ == "__main__":
    main()
