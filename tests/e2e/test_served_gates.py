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
from tokcap_core import reassemble
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import ControlPlaneClient

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
