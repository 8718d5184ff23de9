"""The TokenSink contract, held against MemorySink (the reference) and TQSink (real TQ)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tq.support import fresh_tq_sink, rows_of
from tokcap_core import (
    MemorySink,
    MissingRows,
    SinkError,
    StagedCall,
    TokenSink,
    TrainingRow,
    simulate_rollout,
)
from tokcap_core.testing import simulated_rollouts, staged_calls

_SETTINGS = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(params=["memory", pytest.param("tq", marks=pytest.mark.integration)])
def sink(request: pytest.FixtureRequest) -> TokenSink:
    if request.param == "memory":
        return MemorySink()
    request.getfixturevalue("tq_cluster")
    return fresh_tq_sink()


def _calls(rollout_id: str, *, seed: int = 0, routes: bool = True) -> list[StagedCall]:
    return simulate_rollout(rollout_id, seed=seed, turns=4, routes=routes).calls


def _unique(calls: Sequence[StagedCall]) -> list[StagedCall]:
    return list({c.key: c for c in calls}.values())


def test_sinks_implement_the_protocol(sink: TokenSink) -> None:
    assert isinstance(sink, TokenSink)


@_SETTINGS
@given(calls=st.lists(staged_calls(), min_size=1, max_size=6))
def test_put_get_round_trip_keeps_digests(sink: TokenSink, calls: list[StagedCall]) -> None:
    calls = _unique(calls)
    keys = [c.key for c in calls]

    async def check() -> None:
        await sink.put(calls)
        got = await sink.get(list(reversed(keys)))
        assert got == list(reversed(calls))
        assert all(c.compute_digest() == c.digest for c in got)
        assert all(
            (c.routes is None) == (o.routes is None)
            for c, o in zip(got, reversed(calls), strict=True)
        )
        await sink.clear(keys)

    anyio.run(check, backend="asyncio")


@_SETTINGS
@given(
    rollouts=st.lists(
        simulated_rollouts(max_turns=4),
        min_size=1,
        max_size=3,
        unique_by=lambda r: r.ledger.rollout_id,
    )
)
def test_training_rows_publish_fetch_clear(sink: TokenSink, rollouts: list[Any]) -> None:
    from tokcap_tq import to_padded_batch

    rows = {r.key: r for rollout in rollouts for r in rows_of(rollout)}

    async def check() -> None:
        await sink.publish(rows)
        got = await sink.fetch(list(rows))
        assert got == list(rows.values())
        batch = to_padded_batch(got, pad_id=0)
        assert batch["input_ids"].shape[0] == len(got)
        if any(r.routes is not None for r in got):
            assert str(batch["routes"].dtype) == "torch.int32"
        await sink.clear_rows(list(rows))
        with pytest.raises(MissingRows):
            await sink.fetch(list(rows))

    anyio.run(check, backend="asyncio")


@pytest.mark.anyio
async def test_partial_miss_names_exactly_the_missing_keys(sink: TokenSink) -> None:
    calls = _calls("partial")
    await sink.put(calls[:2])
    absent = [c.key for c in calls[2:]] + ["partial/never"]
    with pytest.raises(MissingRows) as info:
        await sink.get([calls[0].key, *absent, calls[1].key])
    assert set(info.value.missing) == set(absent)
    with pytest.raises(MissingRows) as info:
        await sink.get(["nowhere/at-all"])
    assert info.value.missing == ("nowhere/at-all",)


@pytest.mark.anyio
async def test_duplicate_put_is_idempotent_and_conflicting_put_refused(sink: TokenSink) -> None:
    calls = _calls("dup")
    await sink.put(calls)
    await sink.put(calls)
    changed = dataclasses.replace(calls[0], weight_version=calls[0].weight_version + 1)
    with pytest.raises(SinkError) as info:
        await sink.put([changed, *calls[1:]])
    assert info.value.code == "conflicting_put"
    assert await sink.get([c.key for c in calls]) == calls


@pytest.mark.anyio
async def test_clear_then_get_raises_and_clear_of_absent_keys_is_fine(sink: TokenSink) -> None:
    calls = _calls("cleared")
    keys = [c.key for c in calls]
    await sink.clear(["cleared/absent"])
    await sink.put(calls)
    await sink.clear([*keys[:1], "cleared/absent"])
    with pytest.raises(MissingRows) as info:
        await sink.get(keys)
    assert info.value.missing == (keys[0],)
    assert await sink.get(keys[1:]) == calls[1:]
    await sink.clear(keys)
    await sink.clear(keys)


@pytest.mark.anyio
async def test_publish_refuses_a_row_under_another_key(sink: TokenSink) -> None:
    row = rows_of(simulate_rollout("mismatch", seed=1))[0]
    with pytest.raises(SinkError) as info:
        await sink.publish({"other/s000": row})
    assert info.value.code == "key_mismatch"


@pytest.mark.anyio
async def test_concurrent_puts_gets_and_clears(sink: TokenSink) -> None:
    rollouts = [_calls(f"conc{i}", seed=i, routes=i % 2 == 0) for i in range(16)]
    seen: list[list[StagedCall]] = []

    async def life(calls: list[StagedCall]) -> None:
        keys = [c.key for c in calls]
        await sink.put(calls)
        seen.append(await sink.get(keys))
        await sink.clear(keys)
        with pytest.raises(MissingRows):
            await sink.get(keys)

    async with anyio.create_task_group() as tg:
        for calls in rollouts:
            tg.start_soon(life, calls)
    assert sorted(map(tuple, seen), key=lambda cs: cs[0].key) == sorted(
        map(tuple, rollouts), key=lambda cs: cs[0].key
    )


@pytest.mark.anyio
async def test_padded_batch_widens_routes_to_int32(sink: TokenSink) -> None:
    import torch

    from tokcap_tq import to_padded_batch

    rows = [
        r
        for i in range(3)
        for r in rows_of(simulate_rollout(f"wide{i}", seed=i, turns=3, routes=True))
    ]
    await sink.publish({r.key: r for r in rows})
    fetched: list[TrainingRow] = await sink.fetch([r.key for r in rows])
    batch = to_padded_batch(fetched, pad_id=7)
    width = max(len(r.input_ids) for r in rows)
    assert batch["input_ids"].dtype == torch.int64
    assert batch["input_ids"].shape == (len(rows), width)
    assert batch["logprobs"].dtype == torch.float32
    assert batch["routes"].dtype == torch.int32
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        assert batch["input_ids"][b, :n].tolist() == list(row.input_ids)
        assert batch["input_ids"][b, n:].eq(7).all()
        assert batch["loss_mask"][b, :n].tolist() == list(row.loss_mask)
        assert row.routes is not None
        assert batch["routes"][b, :n].flatten().tolist() == list(row.routes.data)
        assert batch["routes"][b, n:].eq(-1).all()
    assert batch["sample_mask"].tolist() == [r.sample_mask for r in rows]
