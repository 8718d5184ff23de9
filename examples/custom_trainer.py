"""A custom trainer on tokcap, end to end on this machine (the tiny model, a CPU engine).

``python examples/custom_trainer.py [MODEL_DIR]`` places a run (`tokcap.compose.place`:
vLLM's OpenAI server with the tokcap gate, TransferQueue on a loopback Ray, the Ray
reassembler pool) and runs on it the loop ``tokcap train`` runs (`tokcap.loop.train`),
one step of it:

1. **play**: a black-box harness (the real ``openai`` client) plays 2 groups x 3 rollouts
   through the gate, and your scorer scores each one;
2. **collect**: `Stack.collect` closes every rollout with its reward and witness in one
   batch (one durable ledger write for all), verifies each receipt against its ledger
   head, reassembles on the pool with the *receipts'* rewards, decides each group
   (accept, replace, drop) and computes advantages for accepted groups only;
3. **train**: your optimizer step on ``batch.rows`` and ``batch.advantages``;
4. **push**: ``await run.push(trainer)``, its new weights into every engine (place the run
   with a ``push_mode``; ``tokcap train`` pushes every step);
5. **finish**: `Stack.finish` frees the rows and releases the rollouts on the gate.

Copy it and swap in your harness, your scorer and your optimizer step.

``python examples/custom_trainer.py --ray-address HOST:PORT --gate URL [--gate URL ...]``
does the same through gates someone started by hand (``tokcap-vllm serve MODEL
--tokcap-sink tq --tokcap-ray-address HOST:PORT --tokcap-return-token-ids``, their token in
``TOKCAP_CONTROL_TOKEN``): TransferQueue and the pool run on that cluster, what a dead
trainer left on the gates is reclaimed first, each rollout is opened through a
`tokcap_vllm.GateFleet` (``run.fleet``), and every row is checked against the ids the
engine returned to the harness.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import tokcap

tokcap.prepare_environment()  # before vLLM, torch or Ray are imported

import anyio  # noqa: E402
import openai  # noqa: E402

from tokcap.compose import Batch, Finished, Run, Site, place, play_rollouts, tq_sink  # noqa: E402
from tokcap.tiny import QWEN_VLLM_ARGS, build_tiny_model  # noqa: E402
from tokcap_core import Accept, CaptureConfig  # noqa: E402
from tokcap_tq import TQSink, TQSinkConfig  # noqa: E402

STEPS, GROUPS, ROLLOUTS = 1, 2, 3


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the run is (`tokcap.compose.Placement`): one gate in this process serving
    ``model``, or the gates at ``gate_urls`` on the Ray cluster at ``ray_address``."""

    model: Path
    gate_urls: tuple[str, ...] = ()
    ray_address: str | None = None
    gates: int = 0  # gates to start as their own processes (`tokcap train --gates N`)
    workers: int = 1  # the Ray reassembler pool's actors


@dataclass(slots=True)
class Chat:
    """One rollout the harness plays; its score once played."""

    rollout_id: str
    group_id: str
    finished: Finished | None = None
    engine_ids: list[int] = field(default_factory=list)
    """The ids the engine returned (gates run with ``--tokcap-return-token-ids`` only)."""


async def play(run: Run, step: int) -> list[Chat]:
    """The harness: one scored chat per rollout, each through the gate on its own URL (over
    a fleet, each rollout is opened first, on the gate with the fewest open rollouts)."""
    chats = [
        Chat(f"ex-s{step}-g{g}-r{i}", f"ex-s{step}-g{g}")
        for g in range(GROUPS)
        for i in range(ROLLOUTS)
    ]
    ids = run.fleet is not None  # hand-started gates return the engine's ids

    async def one(client: openai.AsyncOpenAI, model: str, chat: Chat, n: int) -> None:
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

    if run.fleet is not None:
        for c in chats:
            await run.fleet.open(c.rollout_id)
    await play_rollouts(run.stack.gate, chats, one, concurrency=8)
    return chats


def report(batch: Batch, chats: list[Chat], ids: bool) -> None:
    """What the step collected."""
    accepted = [g for g, d in batch.decisions.items() if isinstance(d, Accept)]
    print(f"receipts verified {batch.receipts_verified}/{len(batch.receipts)}")
    print(f"groups accepted {len(accepted)}/{len(batch.groups)}; rows {len(batch.rows)}")
    print(f"advantages {[round(a, 3) for a in batch.advantages]}")
    print(f"collect timings {batch.timings}")
    if ids:
        engine = {c.rollout_id: c.engine_ids for c in chats}
        same = sum(list(r.input_ids) == engine[r.rollout_id] for r in batch.rows if r.sample_mask)
        print(f"rows equal to the engine's ids {same}/{len(batch.rows)}")


async def train(site: Site) -> int:
    """The loop, `STEPS` steps on the run; 0 when every receipt verified."""
    failed = 0
    async with site.open() as run:
        for step in range(STEPS):
            chats = await play(run, step)
            batch = await run.stack.collect([c.finished for c in chats if c.finished])
            report(batch, chats, ids=run.fleet is not None)
            # your optimizer step on batch.rows and batch.advantages goes here, then
            # `await run.push(trainer)` (a run placed with push_mode="wait")
            await run.stack.finish(batch)
            failed += batch.receipts_verified != len(batch.receipts)
    return 1 if failed else 0


def main() -> int:
    """Build the tiny model (or take running gates), place the run, train, stop."""
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
        placement = Placement(args.model, tuple(args.gate), args.ray_address)
        sink = TQSink(TQSinkConfig())
    else:
        placement = Placement(build_tiny_model(args.model, kind="dense"))  # built once, cached
        sink = tq_sink("example")
    with place(placement, sink, capture, vllm_args=QWEN_VLLM_ARGS, log=print) as site:
        return anyio.run(train, site)


if __name__ == "__main__":
    raise SystemExit(main())
