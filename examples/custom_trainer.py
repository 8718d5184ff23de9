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
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import tokcap

tokcap.prepare_environment()  # before vLLM, torch or Ray are imported

import anyio  # noqa: E402
import openai  # noqa: E402

from tokcap.compose import (  # noqa: E402
    Finished,
    in_process_gate,
    open_stack,
    play_rollouts,
    services,
    tq_sink,
)
from tokcap.demo import QWEN_VLLM_ARGS  # noqa: E402
from tokcap.tiny import build_tiny_model  # noqa: E402
from tokcap_core import Accept, CaptureConfig  # noqa: E402
from tokcap_tq import TQSink  # noqa: E402
from tokcap_vllm import InProcessServer  # noqa: E402

GROUPS, ROLLOUTS = 2, 3


@dataclass(slots=True)
class Chat:
    """One rollout the harness plays; its score once played."""

    rollout_id: str
    group_id: str
    finished: Finished | None = None


async def play(client: openai.AsyncOpenAI, model: str, chat: Chat, n: int) -> None:
    """The harness: one chat through the gate (``client`` is on the rollout's URL), scored."""
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Task {chat.group_id}: count to three."}],
        max_tokens=8,
        temperature=1.0,
    )
    answer = reply.choices[0].message.content or ""
    reward = len(answer) % 5 / 4  # your scorer here
    chat.finished = Finished(chat.rollout_id, chat.group_id, reward, response_id=reply.id)


async def train(server: InProcessServer, sink: TQSink, capture: CaptureConfig) -> int:
    """Play, collect, (train), finish; 0 when every receipt verified."""
    ready = functools.partial(anyio.to_thread.run_sync, server.wait_ready)
    async with open_stack(
        [server], sink=sink, capture=capture, workers=1, alongside=[ready]
    ) as stack:
        chats = [Chat(f"ex-g{g}-r{i}", f"ex-g{g}") for g in range(GROUPS) for i in range(ROLLOUTS)]
        await play_rollouts(stack.gate, chats, play, concurrency=8)
        batch = await stack.collect([c.finished for c in chats if c.finished is not None])
        accepted = [g for g, d in batch.decisions.items() if isinstance(d, Accept)]
        print(f"receipts verified {batch.receipts_verified}/{len(batch.receipts)}")
        print(f"groups accepted {len(accepted)}/{len(batch.groups)}; rows {len(batch.rows)}")
        print(f"advantages {[round(a, 3) for a in batch.advantages]}")
        print(f"collect timings {batch.timings}")
        # your optimizer step on batch.rows and batch.advantages goes here
        await stack.finish(batch)
        return 0 if batch.receipts_verified == len(batch.receipts) else 1


def main() -> int:
    """Build the tiny model, start the stack, run one step, shut everything down."""
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".tokcap/tiny/dense")
    model = build_tiny_model(folder, kind="dense")  # built once, then cached
    capture = CaptureConfig(segments="terminal", min_valid_fraction=0.5).with_derived(
        environ=os.environ
    )  # mints the control token the gate and the trainer share
    sink = tq_sink("example")
    server = in_process_gate(str(model), capture=capture, sink=sink, vllm_args=QWEN_VLLM_ARGS)
    with services(server, workers=1):
        return anyio.run(train, server, sink, capture)


if __name__ == "__main__":
    raise SystemExit(main())
