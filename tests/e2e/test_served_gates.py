"""Gates as their own ``tokcap-vllm serve`` processes, staging into TransferQueue on Ray.

This process is the trainer: it runs Ray and TransferQueue (``tq_cluster``) and the two
real ``tokcap-vllm serve --tokcap-sink tq`` gates of the shared fleet (``served_fleet``,
tests/conftest.py) join that cluster as drivers; it plays chats through them with the
real openai client, and reads the staged calls back through `TQSink` from its own process.
"""

from __future__ import annotations

from typing import Any

import anyio
import openai
import pytest

from tests.e2e._fleet import SharedFleet
from tests.e2e._gates import ServedGate
from tokcap.compose import reclaim_rollouts
from tokcap_core import reassemble
from tokcap_tq import TQSink
from tokcap_vllm import ControlPlaneClient, GateFleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def gates(served_fleet: SharedFleet) -> list[ServedGate]:
    """The shared fleet's two gates (require-open, ids returned, on the default partitions
    of this process's TransferQueue), taking weight pushes from this process (vLLM's
    weight-transfer routes, ``tokcap_shm``)."""
    return served_fleet.up()


@pytest.fixture
def token(served_fleet: SharedFleet) -> str:
    return served_fleet.token


@pytest.fixture
def sink(served_fleet: SharedFleet) -> TQSink:
    return TQSink(served_fleet.sink)


async def _chat(base_url: str, content: str) -> Any:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    try:
        return await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=1.0,
            seed=7,
            extra_body={"return_token_ids": True},
        )
    finally:
        await client.close()


def test_a_trainer_in_another_process_reads_the_engines_ids_from_tq(
    gates: list[ServedGate], sink: TQSink, token: str
) -> None:
    gate = gates[0]

    async def run() -> None:
        rid = "served-tq-1"
        async with ControlPlaneClient(gate.url, token) as cp:
            await cp.open(rid)
        answer = await _chat(f"{gate.url}/tokcap/rollouts/{rid}/v1", "hello there")
        async with ControlPlaneClient(gate.url, token) as cp:
            health = await cp.health()
            assert health.sink == "TQSink"
            assert health.warnings == []
            head = await cp.close(rid, reward=1.0)
            (receipt,) = await cp.fetch_receipts([rid], expected_heads={rid: head})
            assert receipt.status == "verified"
            staged = await sink.get(list(receipt.sink_keys))
            (row,) = reassemble(receipt, staged, max_seq_len=1024)
            engine_ids = [*answer.prompt_token_ids, *answer.choices[0].token_ids]
            assert list(row.input_ids) == engine_ids
            await sink.clear(list(receipt.sink_keys))
            await cp.release(rid)

    anyio.run(run)


async def _play(fleet: GateFleet, rollout_ids: list[str]) -> dict[str, list[int]]:
    """Open each rollout through the fleet and play one chat on it; the engine's ids."""
    ids: dict[str, list[int]] = {}
    for rid in rollout_ids:
        answer = await _chat(await fleet.open(rid), f"tell me about {rid}")
        ids[rid] = [*answer.prompt_token_ids, *answer.choices[0].token_ids]
    return ids


async def _train_rows(
    fleet: GateFleet, sink: TQSink, rids: list[str], heads: dict[str, tuple[int, str]]
) -> dict[str, Any]:
    """Receipts from every gate, rows from TQ for the verified ones; everything freed."""
    receipts = await fleet.fetch_receipts(rids, expected_heads=heads)
    rows = {}
    for receipt in receipts:
        if receipt.status == "verified":
            (rows[receipt.rollout_id],) = reassemble(
                receipt, await sink.get(list(receipt.sink_keys)), max_seq_len=1024
            )
        await sink.clear(list(receipt.sink_keys))
    await sink.clear(fleet.orphaned_keys(await sink.staged_keys()))
    for rid in rids:
        await fleet.release(rid)
    return {"receipts": {r.rollout_id: r for r in receipts}, "rows": rows}


def test_a_fleet_opens_each_rollout_on_one_gate_and_routes_to_it(
    gates: list[ServedGate], sink: TQSink, token: str
) -> None:
    async def run() -> None:
        rids = [f"fleet-{i}" for i in range(4)]
        async with GateFleet([g.url for g in gates], token) as fleet:
            engine_ids = await _play(fleet, rids)
            owners = [fleet.gate_url(r) for r in rids]
            assert owners == [gates[0].url, gates[1].url, gates[0].url, gates[1].url]
            assert await fleet.open(rids[0]) == f"{gates[0].url}/tokcap/rollouts/{rids[0]}/v1"
            assert [r.open for r in fleet.report()] == [2, 2]
            heads = {rid: await fleet.close(rid, reward=1.0) for rid in rids}
            trained = await _train_rows(fleet, sink, rids, heads)
            for rid in rids:
                assert trained["receipts"][rid].status == "verified"
                assert list(trained["rows"][rid].input_ids) == engine_ids[rid]
            assert [(r.opened, r.closed, r.released) for r in fleet.report()] == [(2, 2, 2)] * 2
        for gate in gates:
            async with ControlPlaneClient(gate.url, token) as cp:
                assert await cp.rollouts() == []  # nothing held on either gate
        assert not [k for k in await sink.staged_keys() if k.startswith("fleet-")]

    anyio.run(run)


def test_a_require_open_gate_refuses_rollouts_nobody_opened_there(
    gates: list[ServedGate], sink: TQSink, token: str
) -> None:
    async def run() -> None:
        async with GateFleet([gates[0].url], token) as fleet:
            await fleet.open("opened-on-0")
            for url, rid in ((gates[1].url, "opened-on-0"), (gates[0].url, "never-opened")):
                with pytest.raises(openai.NotFoundError) as refused:
                    await _chat(f"{url}/tokcap/rollouts/{rid}/v1", "hi")
                assert "unknown_rollout" in str(refused.value)
            await fleet.close("opened-on-0")  # opened, never called: closable, nothing trained
            (receipt,) = await fleet.fetch_receipts(["opened-on-0"])
            assert receipt.failure_reason == "no_terminal"
            await fleet.release("opened-on-0")

    anyio.run(run)


def test_a_restarted_trainer_reclaims_what_the_dead_one_left_on_every_gate(
    gates: list[ServedGate], sink: TQSink, token: str
) -> None:
    """A trainer dies mid-step (its fleet client dropped with rollouts open, one closed and
    never released); the next trainer's `reclaim_rollouts`, under the same owner, leaves
    nothing held. Another trainer, active meanwhile, reclaims none of them (Q1)."""
    urls = [g.url for g in gates]

    async def dead_trainer() -> None:
        async with GateFleet(urls, token, owner="trainer-a") as fleet:  # its work stays
            await _play(fleet, [f"dead-{i}" for i in range(4)])
            await fleet.close("dead-0", reward=1.0)

    async def run() -> None:
        await dead_trainer()
        held = []
        for url in urls:
            async with ControlPlaneClient(url, token) as cp:
                held.append(sorted((r.rollout_id, r.state) for r in await cp.rollouts()))
        assert held == [
            [("dead-0", "closed"), ("dead-2", "open")],
            [("dead-1", "open"), ("dead-3", "open")],
        ]
        assert [k for k in await sink.staged_keys() if k.startswith("dead-")]
        other = {urls[0]: 0, urls[1]: 0}
        assert await reclaim_rollouts(urls, token, sink, owner="trainer-b") == other
        assert [k for k in await sink.staged_keys() if k.startswith("dead-")]
        taken = {urls[0]: 2, urls[1]: 2}
        assert await reclaim_rollouts(urls, token, sink, owner="trainer-a") == taken
        for url in urls:
            async with ControlPlaneClient(url, token) as cp:
                assert await cp.rollouts() == []
        assert not [k for k in await sink.staged_keys() if k.startswith("dead-")]
        assert await reclaim_rollouts(urls, token, sink, owner="trainer-a") == other

    anyio.run(run)


@pytest.mark.kills_a_fleet_gate
def test_a_gate_killed_mid_step_poisons_its_rollouts_and_the_run_goes_on(
    served_fleet: SharedFleet, sink: TQSink, token: str
) -> None:
    """Runs last among the fleet's users (its marker, tests/conftest.py; were it not,
    the fleet would start the dead gate again for the next): it kills the second gate's
    process (API server and engine core) while a step plays, through the composition
    ``tokcap train --gates`` runs: its rollouts are poisoned and counted, the step trains on
    the first gate's, nothing stays in TransferQueue or on the live gate, the push goes to
    the live gate and the next step trains at the pushed weights."""
    import torch

    from tokcap.compose import (
        Finished,
        FleetEndpoint,
        lost_receipts,
        open_stack,
        play_rollouts,
        push_to_live_gates,
    )
    from tokcap.loop import load_policy
    from tokcap.train import TrainConfig, Trainer
    from tokcap_core import CaptureConfig
    from tokcap_vllm.weights import FleetWeightSync

    start = served_fleet.initial_weights()  # the model's own weights, as loaded below
    gates = served_fleet.up()
    tiny_model = served_fleet.model
    urls = [g.url for g in gates]
    capture = CaptureConfig(segments="terminal", max_seq_len=1024, min_valid_fraction=0.5)
    policy = load_policy(tiny_model, 0)
    trainer = Trainer(
        policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), config=TrainConfig(), version=start
    )

    async def step(stack: Any, fleet: GateFleet, rids: list[str], kill_at: int | None) -> Any:
        engine_ids: dict[str, list[int]] = {}
        for rid in rids:
            await fleet.open(rid)

        async def play(client: openai.AsyncOpenAI, model: str, rollout: Finished, n: int) -> None:
            if n == kill_at:  # mid-step: two rollouts played on each gate, four to come
                await anyio.to_thread.run_sync(gates[1].kill)
            answer: Any = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"count to {n}"}],
                max_tokens=8,
                temperature=1.0,
                extra_body={"return_token_ids": True},
            )
            engine_ids[rollout.rollout_id] = [
                *answer.prompt_token_ids,
                *answer.choices[0].token_ids,
            ]

        finished = [Finished(rid, rid[:-3], reward=float(i % 2)) for i, rid in enumerate(rids)]
        await play_rollouts(stack.gate, finished, play, concurrency=1)
        batch = await stack.collect(finished)
        report = await anyio.to_thread.run_sync(trainer.step, batch.rows, batch.advantages)
        assert report.parity.k3 <= 1e-9  # the engine that sampled holds the trainer's weights
        for row in batch.rows:
            if row.sample_mask:
                assert list(row.input_ids) == engine_ids[row.rollout_id]
        return batch, report

    async def run() -> None:
        async with (
            GateFleet(urls, token, retries=1) as fleet,
            FleetWeightSync([(url, token) for url in urls]) as weights,
        ):
            endpoint = FleetEndpoint(fleet, str(tiny_model), urls)
            async with open_stack(
                [endpoint], sink=sink, capture=capture, workers=1, control=fleet
            ) as stack:
                rids = [f"kill-g{g}-r{i}" for g in range(2) for i in range(4)]
                batch, report = await step(stack, fleet, rids, kill_at=4)
                lost = {rid for rid in rids if fleet.gate_url(rid) == gates[1].url}
                assert lost == {rid for i, rid in enumerate(rids) if i % 2}
                for rid, receipt in batch.receipts.items():
                    if rid in lost:
                        assert receipt.status == "poisoned"
                        assert receipt.failure_reason.startswith("gate_unreachable")
                    else:
                        assert receipt.status == "verified"
                assert batch.accepted == ["kill-g0", "kill-g1"]  # 2 of 4 valid in each
                # counted as lost with their gate (what `tokcap train` reports and passes)
                assert lost_receipts(fleet, batch.receipts.values()) == {gates[1].url: 4}
                assert report.rows_valid == 4
                assert report.rows_placeholder == 4
                alive, dead = fleet.report()
                assert (alive.alive, alive.unreachable, dead.alive, dead.unreachable) == (
                    True, 0, False, 4,
                )  # fmt: skip
                assert fleet.metrics()["fleet/gate1/unreachable"] == 4.0
                (info,) = await push_to_live_gates(
                    fleet, weights, trainer.weights(), trainer.version
                )
                assert (info.version, info.phase) == (trainer.version, "READY")
                assert [c.base_url for c in weights.clients] == [gates[0].url]
                await stack.finish(batch)
                assert not [k for k in await sink.staged_keys() if k.startswith("kill-")]
                async with ControlPlaneClient(gates[0].url, token) as cp:
                    assert await cp.rollouts() == []

                rids = [f"next-g0-r{i}" for i in range(4)]  # the run goes on, on gate 0
                batch, report = await step(stack, fleet, rids, kill_at=None)
                assert {fleet.gate_url(rid) for rid in rids} == {gates[0].url}
                assert batch.receipts_verified == 4
                assert {row.weight_version_max for row in batch.rows} == {info.version}
                await stack.finish(batch)
        assert not [k for k in await sink.staged_keys() if k.startswith(("kill-", "next-"))]

    anyio.run(run)
