"""The collection layer against a real gate and engine, without Ray (`tokcap_trl.Collector`).

The gate runs in this process (`tokcap_vllm.InProcessServer`, the tiny model on vLLM's CPU
engine, ``require_open``) and stages into a `tokcap_core.MemorySink` this test also reads,
so the layer's whole path runs for real: open on the fleet, the default chat harness over
HTTP (two turns, vLLM returning its own ids), close, verified receipts, rows rebuilt from
the sink, everything cleared and released. One rollout is scored with a witness no call
matches (its receipt is poisoned) and one harness raises: both are reported, none dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from tests.engine_env import set_cpu_engine_env

set_cpu_engine_env()

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "trl-collect-token"


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An in-process gate on the tiny model, staging into a `MemorySink`; (server, sink)."""
    from tests.e2e._gates import VLLM_ARGS
    from tokcap.tiny import build_tiny_model
    from tokcap_core import CaptureConfig, MemorySink
    from tokcap_vllm import Gate, GateConfig, InProcessServer

    model = build_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")
    sink = MemorySink()
    config = GateConfig(
        capture=CaptureConfig(control_token=TOKEN, return_token_ids=True), require_open=True
    )
    server = InProcessServer(str(model), gate=Gate(config, sink=sink), vllm_args=VLLM_ARGS)
    server.start()
    try:
        yield server, sink
    finally:
        server.stop()


def test_a_batch_is_played_verified_rebuilt_and_freed(gate: Any) -> None:
    from tokcap_trl import Collector, Episode, RolloutPlan, Scored, chat_harness

    server, sink = gate
    engine: dict[str, list[tuple[list[int], list[int]]]] = {}

    def on_response(episode: Episode, response: Any) -> None:
        calls = engine.setdefault(episode.rollout_id, [])
        calls.append((list(response.prompt_token_ids), list(response.choices[0].token_ids)))

    played = chat_harness(
        lambda answers: len("".join(answers)) / 100,
        turns=2,
        max_tokens=8,
        extra_body={"return_token_ids": True},
        on_response=on_response,
    )

    async def harness(client: Any, episode: Episode) -> Scored:
        scored = await played(client, episode)
        assert isinstance(scored, Scored)
        if episode.index == 1:
            return Scored(reward=scored.reward, response_id="chatcmpl-never-served")
        if episode.index == 2:
            raise RuntimeError("the environment crashed")
        return scored

    async def run() -> Any:
        from tokcap_vllm import GateFleet

        async with GateFleet([server.base_url], TOKEN) as fleet:
            collector = Collector(fleet, sink, model=server.model, max_seq_len=1024)
            plans = [
                RolloutPlan(rollout_id=f"collect-{i}", group_id="g0", prompt="Hello there")
                for i in range(4)
            ]
            batch = await collector.collect(plans, harness)
            assert [r.opened for r in fleet.report()] == [4]
            assert [r.released for r in fleet.report()] == [4]
            return batch

    batch = anyio.run(run)
    assert [c.rollout_id for c in batch.rollouts] == [f"collect-{i}" for i in range(4)]
    assert [c.valid for c in batch.rollouts] == [True, False, False, True]
    assert batch.rollouts[1].reason == "witness_unmatched"
    assert batch.rollouts[1].receipt.status == "poisoned"
    assert batch.rollouts[2].reason == "harness_failed:RuntimeError"
    assert batch.rollouts[2].harness_error == "RuntimeError: the environment crashed"
    assert batch.metrics["tokcap/invalid/witness_unmatched"] == 1.0
    assert batch.metrics["tokcap/invalid/harness_failed"] == 1.0
    for c in batch.valid:
        (first_prompt, _), (last_prompt, last_output) = engine[c.rollout_id]
        assert list(c.row.input_ids) == [*last_prompt, *last_output]  # the engine's own ids
        assert c.row.prompt_len == len(first_prompt)
        assert c.row.num_generated == len(engine[c.rollout_id][0][1]) + len(last_output)
        assert c.receipt.status == "verified"
        assert c.reward == c.receipt.reward
    assert anyio.run(sink.staged_keys) == []  # nothing left behind


def test_trls_repeated_prompts_become_groups() -> None:
    from tokcap_core import MemorySink
    from tokcap_trl import GRPORollouts, TRLAdapterError

    rollouts = GRPORollouts(
        ["http://127.0.0.1:1"],
        token=TOKEN,
        sink=MemorySink(),
        harness=lambda client, episode: anyio.sleep(0),  # type: ignore[arg-type,return-value]
        run_id="run",
    )
    plans = rollouts.plans(["a", "a", "b", "b"], 2, batch=3)
    assert [p.group_id for p in plans] == ["run-b000003-g0000"] * 2 + ["run-b000003-g0001"] * 2
    assert [p.rollout_id for p in plans][-1] == "run-b000003-0003"
    with pytest.raises(TRLAdapterError) as refused:
        rollouts.plans(["a", "b", "b", "b"], 2, batch=0)
    assert refused.value.code == "group_mismatch"
    with pytest.raises(TRLAdapterError) as uneven:
        rollouts.plans(["a", "a", "a"], 2, batch=0)
    assert uneven.value.code == "group_mismatch"
    with pytest.raises(TRLAdapterError) as outside:
        rollouts.push({}, 1)
    assert outside.value.code == "not_started"
