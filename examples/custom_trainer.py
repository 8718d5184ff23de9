"""A custom trainer on tokcap, end to end on this machine (the tiny model, a CPU engine).

``python examples/custom_trainer.py [MODEL_DIR]`` starts the stack (vLLM's OpenAI server with
the tokcap gate, TransferQueue on a loopback Ray, the Ray reassembler pool), lets a
black-box harness (the real ``openai`` client) play 2 groups x 3 rollouts through the gate,
then does a trainer's part with `tokcap.compose`:

1. `Stack.collect`: close every rollout with its reward and witness in one batch (one
   durable ledger write for all, `ControlPlaneClient.close_many`), fetch receipts
   verified against the ledger heads, reassemble on the pool with the *receipts'* rewards,
   decide each group (accept, replace, drop), advantages for accepted groups only;
2. your optimizer step on ``batch.rows`` and ``batch.advantages``;
3. `Stack.finish`: free the rows and release the rollouts on the gate.

Copy it and swap in your harness, your scorer and your optimizer step.

``python examples/custom_trainer.py --ray-address HOST:PORT --gate URL [--gate URL ...]``
does the same through gates someone started by hand (``tokcap-vllm serve MODEL
--tokcap-sink tq --tokcap-ray-address HOST:PORT --tokcap-return-token-ids``, their token in
``TOKCAP_CONTROL_TOKEN``): TransferQueue and the pool run on that cluster, each rollout is
opened through a `tokcap_vllm.GateFleet`, and every row is checked against the ids the
engine returned to the harness.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tokcap

tokcap.prepare_environment()  # before vLLM, torch or Ray are imported

import anyio  # noqa: E402
import openai  # noqa: E402

from tokcap.compose import (  # noqa: E402
    Finished,
    FleetEndpoint,
    GateEndpoint,
    Stack,
    in_process_gate,
    open_stack,
    play_rollouts,
    served_model,
    services,
    tq_sink,
)
from tokcap.tiny import QWEN_VLLM_ARGS, build_tiny_model  # noqa: E402
from tokcap_core import Accept, CaptureConfig  # noqa: E402
from tokcap_tq import TQSink, TQSinkConfig  # noqa: E402
from tokcap_vllm import GateFleet, InProcessServer  # noqa: E402

GROUPS, ROLLOUTS = 2, 3


@dataclass(slots=True)
class Chat:
    """One rollout the harness plays; its score once played."""

    rollout_id: str
    group_id: str
    finished: Finished | None = None
    engine_ids: list[int] = field(default_factory=list)
    """The ids the engine returned (gates run with ``--tokcap-return-token-ids`` only)."""


async def play(
    client: openai.AsyncOpenAI, model: str, chat: Chat, n: int, *, ids: bool = False
) -> None:
    """The harness: one chat through the gate (``client`` is on the rollout's URL), scored."""
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Task {chat.group_id}: count to three."}],
        max_tokens=8,
        temperature=1.0,
        extra_body={"return_token_ids": True} if ids else None,
    )
    answer = reply.choices[0].message.content or ""
    reward = len(answer) % 5 / 4  # your scorer here
    chat.finished = Finished(chat.rollout_id, chat.group_id, reward, response_id=reply.id)
    if ids:
        prompt = getattr(reply, "prompt_token_ids", None) or []
        chat.engine_ids = [*prompt, *(getattr(reply.choices[0], "token_ids", None) or [])]


async def step(stack: Stack, fleet: GateFleet | None = None) -> int:
    """Play, collect, (train), finish; 0 when every receipt verified."""
    chats = [Chat(f"ex-g{g}-r{i}", f"ex-g{g}") for g in range(GROUPS) for i in range(ROLLOUTS)]
    if fleet is not None:
        for chat in chats:
            await fleet.open(chat.rollout_id)  # on the gate with the fewest open rollouts
    harness = functools.partial(play, ids=fleet is not None)
    await play_rollouts(stack.gate, chats, harness, concurrency=8)
    batch = await stack.collect([c.finished for c in chats if c.finished is not None])
    accepted = [g for g, d in batch.decisions.items() if isinstance(d, Accept)]
    print(f"receipts verified {batch.receipts_verified}/{len(batch.receipts)}")
    print(f"groups accepted {len(accepted)}/{len(batch.groups)}; rows {len(batch.rows)}")
    print(f"advantages {[round(a, 3) for a in batch.advantages]}")
    print(f"collect timings {batch.timings}")
    if fleet is not None:
        ids = {c.rollout_id: c.engine_ids for c in chats}
        equal = sum(list(r.input_ids) == ids[r.rollout_id] for r in batch.rows if r.sample_mask)
        print(f"rows equal to the engine's ids {equal}/{len(batch.rows)}")
    # your optimizer step on batch.rows and batch.advantages goes here
    await stack.finish(batch)
    return 0 if batch.receipts_verified == len(batch.receipts) else 1


async def train(server: InProcessServer, sink: TQSink, capture: CaptureConfig) -> int:
    """One step through the gate in this process."""
    ready = functools.partial(anyio.to_thread.run_sync, server.wait_ready)
    async with open_stack(
        [server], sink=sink, capture=capture, workers=1, alongside=[ready]
    ) as stack:
        return await step(stack)


async def train_on_gates(urls: Sequence[str], sink: TQSink, capture: CaptureConfig) -> int:
    """One step through gates started by hand, each rollout opened on one of them."""
    assert capture.control_token is not None
    async with GateFleet(urls, capture.control_token) as fleet:
        model = await served_model(urls[0])  # what the gates serve
        gates: GateEndpoint = FleetEndpoint(fleet, model, urls)
        async with open_stack(
            [gates], sink=sink, capture=capture, workers=1, control=fleet
        ) as stack:
            return await step(stack, fleet)


def main() -> int:
    """Build the tiny model (or take running gates), start the stack, run one step, stop."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=".tokcap/tiny/dense", type=Path)
    parser.add_argument("--ray-address", help="the cluster the gates stage into")
    parser.add_argument("--gate", action="append", default=[], help="a gate's URL (repeat)")
    args = parser.parse_args()
    if args.gate and not args.ray_address:
        parser.error("--gate needs --ray-address (the cluster the gates stage into)")
    token_env = "TOKCAP_CONTROL_TOKEN" if args.gate else None  # the gates' token
    capture = CaptureConfig(
        segments="terminal", min_valid_fraction=0.5, control_token_env=token_env
    ).with_derived(environ=os.environ)  # else mints the token the gate and trainer share
    if args.gate:  # the partitions the gates stage into (their defaults)
        sink = TQSink(TQSinkConfig())
        with services(None, workers=1, ray_address=args.ray_address):
            return anyio.run(train_on_gates, args.gate, sink, capture)
    sink = tq_sink("example")
    model = build_tiny_model(args.model, kind="dense")  # built once, then cached
    server = in_process_gate(str(model), capture=capture, sink=sink, vllm_args=QWEN_VLLM_ARGS)
    with services(server, workers=1):
        return anyio.run(train, server, sink, capture)


if __name__ == "__main__":
    raise SystemExit(main())
