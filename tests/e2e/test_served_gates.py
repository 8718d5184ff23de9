"""Gates as their own ``tokcap-vllm serve`` processes, staging into TransferQueue on Ray.

This process is the trainer: it runs Ray and TransferQueue (``tq_cluster``), starts two
real ``tokcap-vllm serve --tokcap-sink tq`` processes that join that cluster as drivers,
plays chats through them with the real openai client, and reads the staged calls back
through `TQSink` from its own process.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tests.e2e._gates import ServedGate
from tokcap.compose import reclaim_rollouts
from tokcap_core import reassemble
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import ControlPlaneClient, GateFleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "served-gates-" + secrets.token_hex(8)
SINK = TQSinkConfig(staging_partition="served_staging", training_partition="served_training")


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from tokcap.tiny import build_tiny_model

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return build_tiny_model(cache / "dense", kind="dense")


@pytest.fixture(scope="module")
def gates(
    tq_cluster: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServedGate]]:
    """Two served gates attached to this process's TransferQueue (require-open)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    logs = tmp_path_factory.mktemp("gates")
    options = [
        "--tokcap-sink",
        "tq",
        "--tokcap-ray-address",
        address,
        "--tokcap-staging-partition",
        SINK.staging_partition,
        "--tokcap-training-partition",
        SINK.training_partition,
        "--tokcap-return-token-ids",
        "--tokcap-require-open",
        "--tokcap-attach-timeout-s",
        "120",
    ]
    started = [
        ServedGate(tiny_model, options, token=TOKEN, log=logs / f"gate{i}.log") for i in range(2)
    ]
    try:
        for gate in started:
            gate.wait_healthy(TOKEN)
        yield started
    finally:
        for gate in started:
            gate.stop()


@pytest.fixture(scope="module")
def sink(tq_cluster: Any) -> TQSink:
    return TQSink(SINK)


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
    gates: list[ServedGate], sink: TQSink
) -> None:
    gate = gates[0]

    async def run() -> None:
        rid = "served-tq-1"
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
            await cp.open(rid)
        answer = await _chat(f"{gate.url}/tokcap/rollouts/{rid}/v1", "hello there")
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
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
    gates: list[ServedGate], sink: TQSink
) -> None:
    async def run() -> None:
        rids = [f"fleet-{i}" for i in range(4)]
        async with GateFleet([g.url for g in gates], TOKEN) as fleet:
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
            async with ControlPlaneClient(gate.url, TOKEN) as cp:
                assert await cp.rollouts() == []  # nothing held on either gate
        assert not [k for k in await sink.staged_keys() if k.startswith("fleet-")]

    anyio.run(run)


def test_a_require_open_gate_refuses_rollouts_nobody_opened_there(
    gates: list[ServedGate], sink: TQSink
) -> None:
    async def run() -> None:
        async with GateFleet([gates[0].url], TOKEN) as fleet:
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
    gates: list[ServedGate], sink: TQSink
) -> None:
    """A trainer dies mid-step (its fleet client dropped with rollouts open, one closed and
    never released); the next trainer's `reclaim_rollouts` leaves nothing held."""
    urls = [g.url for g in gates]

    async def dead_trainer() -> None:
        async with GateFleet(urls, TOKEN) as fleet:  # its connections end; its work stays
            await _play(fleet, [f"dead-{i}" for i in range(4)])
            await fleet.close("dead-0", reward=1.0)

    async def run() -> None:
        await dead_trainer()
        held = []
        for url in urls:
            async with ControlPlaneClient(url, TOKEN) as cp:
                held.append(sorted((r.rollout_id, r.state) for r in await cp.rollouts()))
        assert held == [
            [("dead-0", "closed"), ("dead-2", "open")],
            [("dead-1", "open"), ("dead-3", "open")],
        ]
        assert [k for k in await sink.staged_keys() if k.startswith("dead-")]
        assert await reclaim_rollouts(urls, TOKEN, sink) == {urls[0]: 2, urls[1]: 2}
        for url in urls:
            async with ControlPlaneClient(url, TOKEN) as cp:
                assert await cp.rollouts() == []
        assert not [k for k in await sink.staged_keys() if k.startswith("dead-")]
        assert await reclaim_rollouts(urls, TOKEN, sink) == {urls[0]: 0, urls[1]: 0}

    anyio.run(run)


def test_a_gate_killed_mid_step_poisons_only_its_own_rollouts(
    gates: list[ServedGate], sink: TQSink
) -> None:
    """Runs last: it kills the second gate."""

    async def run() -> None:
        rids = [f"kill-{i}" for i in range(4)]
        async with GateFleet([g.url for g in gates], TOKEN, retries=1) as fleet:
            engine_ids = await _play(fleet, rids)
            gates[1].kill()
            heads = {rid: await fleet.close(rid, reward=1.0) for rid in rids}
            trained = await _train_rows(fleet, sink, rids, heads)
            receipts = trained["receipts"]
            for rid in ("kill-0", "kill-2"):  # the live gate's rollouts train
                assert receipts[rid].status == "verified"
                assert list(trained["rows"][rid].input_ids) == engine_ids[rid]
            for rid in ("kill-1", "kill-3"):
                assert receipts[rid].status == "poisoned"
                assert receipts[rid].failure_reason.startswith("gate_unreachable")
            alive, dead = fleet.report()
            assert (alive.alive, alive.unreachable, alive.released) == (True, 0, 2)
            assert (dead.alive, dead.unreachable) == (False, 2)
            assert fleet.metrics()["fleet/gate1/unreachable"] == 2.0
        assert not [k for k in await sink.staged_keys() if k.startswith("kill-")]
        async with ControlPlaneClient(gates[0].url, TOKEN) as cp:
            assert await cp.rollouts() == []

    anyio.run(run)
