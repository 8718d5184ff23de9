"""The reassembler pool on a real local Ray, against the reference sink across processes.

One pool (2 actors, 0.5 CPU each) on one `ScriptedSink` serves the whole module: actor
start-up dominates on a small machine. Groups have distinct ids, so each test checks
only its own keys; the scripted sink stalls in ``publish`` for ``stall-*``/``half-*``
groups so a test can kill the actor mid-request.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import ray

from tests.ray.support import ScriptedSink, make_group
from tokcap_core import FinalizedGroup, MemorySink, ReassemblyRequest, StagedCall
from tokcap_core.rows import on_chain_keys, reassemble_group
from tokcap_ray import TIMING_KEYS, ActorSink, ReassemblerPool, step_metrics

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
async def sink(ray_cluster: Any) -> AsyncIterator[ActorSink]:
    """The reference sink (a `MemorySink` in its own actor), seen from the driver."""
    sink = ActorSink.start()
    yield sink
    ray.kill(sink.handle, no_restart=True)


@pytest.fixture(scope="module")
async def pool(sink: ActorSink) -> AsyncIterator[ReassemblerPool]:
    """Two reassembler actors whose sink is a `ScriptedSink` proxy to ``sink``'s actor."""
    factory = functools.partial(ScriptedSink, sink.handle)
    async with ReassemblerPool(2, factory, num_cpus=0.5, max_in_flight=32) as pool:
        yield pool


def _in_process(request: ReassemblyRequest, staged: dict[str, StagedCall]) -> Any:
    return reassemble_group(request, staged, staging_cleared=request.clear_staging)


def _core_metrics(finalized: FinalizedGroup) -> dict[str, float]:
    """The core's metrics (the pool adds its timings and its ``staging/*`` counts)."""
    pool_keys = {*TIMING_KEYS, "staging/missing_keys", "staging/read_ahead_keys"}
    return {k: v for k, v in finalized.metrics.items() if k not in pool_keys}


async def _staged_group(sink: ActorSink, group_id: str, kinds: list[str]) -> Any:
    request, staged = make_group(group_id, kinds)
    await sink.put(list(staged.values()))
    return request, staged


async def _held(sink: ActorSink, group_id: str) -> tuple[list[str], list[str]]:
    """The group's training keys and staging keys the sink holds, sorted."""
    mine = f"{group_id}-r"
    rows = sorted(k for k in await sink.row_keys() if k.startswith(mine))
    staged = sorted(k for k in await sink.staged_keys() if k.startswith(mine))
    return rows, staged


async def test_mixed_group_publishes_one_row_per_segment_and_a_placeholder_per_failure(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    kinds = ["ok", "forest", "poisoned", "tampered", "missing", "ok"]
    request, staged = await _staged_group(sink, "mixed", kinds)
    finalized = await pool.submit(request)
    expected = _in_process(request, staged)
    assert finalized.outcome == "published"
    assert finalized.total_row_count == 5 + 2  # the forest has two segments
    assert finalized.valid_row_count == 4
    assert dict(finalized.failures) == {
        "mixed-r2": "engine_failed:oom",
        "mixed-r3": "reassembly_failed:digest_mismatch",
        "mixed-r4": "missing_rows",
    }
    rows = await sink.fetch(finalized.training_keys)
    assert rows == list(expected.rows.values())
    placeholders = [r for r in rows if r.sample_mask == 0]
    assert [r.reason for r in placeholders] == [reason for _, reason in finalized.failures]
    assert await _held(sink, "mixed") == (sorted(finalized.training_keys), [])
    assert finalized.staging_cleared  # every admitted call's staging key, off-chain too
    metrics = finalized.metrics
    assert metrics["staging/missing_keys"] == 1.0
    assert metrics["failures/missing_rows"] == 1.0
    assert metrics["failures/reassembly_failed"] == 1.0
    assert metrics["failures/engine_failed"] == 1.0
    assert all(metrics[k] >= 0.0 for k in TIMING_KEYS)
    assert _core_metrics(finalized) == _core_metrics(expected.finalized)
    step = step_metrics([finalized, finalized])
    assert step["rows/total"] == 14.0
    assert step["groups/total"] == 2.0
    assert step["rows/valid_fraction"] == pytest.approx(4 / 7)


async def test_a_retry_after_success_returns_the_same_group_and_publishes_nothing(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    request, _ = await _staged_group(sink, "again", ["ok", "ok", "poisoned"])
    deaths = pool.stats["actor_deaths"]
    first = await pool.submit(request)
    await sink.clear_rows(first.training_keys)  # the trainer consumed them
    assert await pool.submit(request) == first
    ray.kill(pool.actor_for(request.group_id), no_restart=True)  # and on a fresh actor
    with anyio.fail_after(60):
        again = await pool.submit(request)
    concurrent = await pool.map([request, request])
    assert again == first
    assert concurrent == [first, first]
    assert await _held(sink, "again") == ([], [])  # nothing was published a second time
    assert pool.stats["actor_deaths"] == deaths + 1


async def test_a_publish_cut_short_before_its_record_landed_is_completed_not_doubled(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    # An attempt that died with its publish half done and its ``publishing`` record not yet
    # landed (the two travel together) left some rows and no record: the redo finds the
    # staged calls still there, and the rows it rebuilds are the same, so the held ones
    # are kept and the rest written.
    request, staged = await _staged_group(sink, "cut", ["ok", "ok", "ok"])
    expected = _in_process(request, staged)
    half = dict(list(expected.rows.items())[:2])
    await sink.publish(half)
    assert await pool.record("cut") is None
    finalized = await pool.submit(request)
    assert finalized.outcome == "published"
    assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())
    assert await _held(sink, "cut") == (sorted(expected.rows), [])


async def _submit_and_kill(pool: ReassemblerPool, request: ReassemblyRequest) -> FinalizedGroup:
    """Submit, wait until the actor recorded ``publishing``, kill it, return the result."""
    result: list[FinalizedGroup] = []
    deaths = pool.stats["actor_deaths"]

    async def submit() -> None:
        result.append(await pool.submit(request))

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit)
            while (record := await pool.record(request.group_id)) is None:
                await anyio.sleep(0.05)
            assert record.state == "publishing"
            ray.kill(pool.actor_for(request.group_id), no_restart=True)
    assert pool.stats["actor_deaths"] == deaths + 1
    return result[0]


async def _killed_and_published(
    sink: ActorSink, pool: ReassemblerPool, group: str, behaviours: list[str]
) -> tuple[FinalizedGroup, FinalizedGroup]:
    """Stage ``group``, kill its actor at ``publishing`` (`_submit_and_kill`) and check its
    rows were published exactly once: the pool's result and the in-process one."""
    request, staged = await _staged_group(sink, group, behaviours)
    finalized = await _submit_and_kill(pool, request)
    expected = _in_process(request, staged)
    assert finalized.outcome == "published"
    assert await _held(sink, group) == (sorted(expected.rows), [])  # clear finished
    assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())
    return finalized, expected.finalized


async def test_an_actor_killed_before_its_publish_wrote_is_replaced_and_the_group_redone(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    behaviours = ["ok", "forest", "missing"]
    finalized, _ = await _killed_and_published(sink, pool, "stall-before", behaviours)
    assert finalized.metrics["time/publish_ms"] > 0.0  # the replacement published


async def test_an_actor_killed_after_its_publish_wrote_is_not_republished(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    behaviours = ["ok", "poisoned", "ok"]
    finalized, expected = await _killed_and_published(sink, pool, "stall-after", behaviours)
    assert _core_metrics(finalized) == _core_metrics(expected)
    assert finalized.metrics["time/publish_ms"] == 0.0  # recovered: the dead actor published


async def test_an_actor_killed_mid_write_reports_an_unknown_outcome_with_the_keys(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    request, staged = await _staged_group(sink, "half", ["ok", "ok", "ok", "ok"])
    finalized = await _submit_and_kill(pool, request)
    assert await pool.submit(request) == finalized  # stays unknown: never guessed
    assert finalized.outcome == "unknown"
    assert not finalized.staging_cleared
    assert sorted(finalized.training_keys) == sorted(_in_process(request, staged).rows)
    rows, staging = await _held(sink, "half")
    assert len(rows) == 2
    assert staging == sorted(staged)  # not cleared: the controller decides what to do


def _same_slot(pool: ReassemblerPool, prefix: str, n: int) -> list[str]:
    """``n`` group ids starting with ``prefix`` that route to one actor slot."""
    ids = (f"{prefix}{i}" for i in range(1000))
    slot = pool.slot_of(f"{prefix}0")
    return [g for g in ids if pool.slot_of(g) == slot][:n]


async def test_the_groups_of_a_step_spread_over_the_actors(pool: ReassemblerPool) -> None:
    # A step's group ids differ only in their last digits (crc32 sent them all to one slot).
    for step in range(16):
        slots = {pool.slot_of(f"train-s{step:04d}-g{g:02d}") for g in range(8)}
        assert slots == set(range(pool.config.num_workers)), step


async def test_groups_never_sent_go_to_their_actor_in_one_bundle_and_publish_once(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    groups = [
        await _staged_group(sink, g, ["ok", "forest", "missing"])
        for g in _same_slot(pool, "bundle", 3)
    ]
    bundled = pool.stats["bundled"]
    finished = await pool.map([request for request, _ in groups])
    assert pool.stats["bundled"] == bundled + 3  # one call for the three
    assert len({f.metrics["time/fetch_ms"] for f in finished}) == 1  # one shared fetch
    for (request, staged), finalized in zip(groups, finished, strict=True):
        expected = _in_process(request, staged)
        assert finalized.group_id == request.group_id
        assert _core_metrics(finalized) == _core_metrics(expected.finalized)
        assert finalized.metrics["staging/missing_keys"] == 1.0  # its own, not the bundle's
        assert await _held(sink, request.group_id) == (sorted(expected.rows), [])
        assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())
    assert await pool.map([groups[0][0]]) == finished[:1]  # a retry: its record, alone
    assert pool.stats["bundled"] == bundled + 3


async def test_new_groups_of_both_slots_go_in_one_bundle_and_a_duplicate_waits_for_it(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    ids = [f"across{i}" for i in range(6)]
    assert {pool.slot_of(g) for g in ids} == {0, 1}
    groups = [await _staged_group(sink, g, ["ok", "ok"]) for g in ids]
    requests = [request for request, _ in groups]
    bundled = pool.stats["bundled"]
    finished = await pool.map([*requests, requests[0]])
    assert pool.stats["bundled"] == bundled + 6  # one call for the six
    assert len({f.metrics["time/fetch_ms"] for f in finished[:6]}) == 1  # one shared fetch
    duplicate = finished[6]
    assert (duplicate.group_id, duplicate.outcome, duplicate.training_keys) == (
        finished[0].group_id,
        "published",
        finished[0].training_keys,
    )
    for (request, staged), finalized in zip(groups, finished, strict=False):
        expected = _in_process(request, staged)
        assert await _held(sink, request.group_id) == (sorted(expected.rows), [])
        assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())


async def test_enough_new_groups_are_split_evenly_over_the_actors(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    groups = [await _staged_group(sink, f"even{i}", ["ok"]) for i in range(9)]
    bundled = pool.stats["bundled"]
    finished = await pool.map([request for request, _ in groups])
    assert pool.stats["bundled"] == bundled + 9
    fetches = [f.metrics["time/fetch_ms"] for f in finished]  # one per bundle
    assert sorted(fetches.count(t) for t in set(fetches)) == [4, 5]  # two actors, 4 + 5
    for (request, staged), finalized in zip(groups, finished, strict=True):
        assert await sink.fetch(finalized.training_keys) == list(
            _in_process(request, staged).rows.values()
        )


async def test_calls_read_ahead_are_taken_and_only_the_later_ones_are_read(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    request, staged = make_group("ahead", ["ok", "ok", "ok"])
    early = [c for k, c in staged.items() if not k.startswith("ahead-r2/")]
    await sink.put(early)
    actor = pool.actor_for("ahead")  # where a group sent alone goes
    assert await actor.prefetch.remote(list(request.rollout_ids)) == len(early)
    await sink.put([c for k, c in staged.items() if k.startswith("ahead-r2/")])  # staged late
    finalized = await pool.submit(request)
    read_ahead = {c.key for c in early} & set(on_chain_keys(request))
    assert 0 < len(read_ahead) < len(on_chain_keys(request))
    assert finalized.metrics["staging/read_ahead_keys"] == len(read_ahead)
    assert finalized.metrics["staging/missing_keys"] == 0.0
    expected = _in_process(request, staged)
    assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())


async def test_the_pool_reads_a_collections_calls_ahead_on_the_actors_its_bundles_go_to(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    groups = [await _staged_group(sink, f"early{i}", ["ok", "ok"]) for i in range(9)]
    requests = [request for request, _ in groups]
    answers = pool.prefetch({r.group_id: r.rollout_ids for r in requests})
    read = [len(staged) for _, staged in groups]
    assert [await answer for answer in answers] == [sum(read[:4]), sum(read[4:])]  # 4 + 5
    finished = await pool.map(requests)
    for (request, staged), finalized in zip(groups, finished, strict=True):
        assert finalized.metrics["staging/read_ahead_keys"] == len(on_chain_keys(request))
        expected = _in_process(request, staged)
        assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())


async def test_a_read_ahead_nobody_takes_is_dropped_after_eight_more(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    request, _ = await _staged_group(sink, "stale", ["ok"])
    actor = pool.actor_for("stale")
    assert await actor.prefetch.remote(list(request.rollout_ids)) > 0
    for i in range(8):  # each reads nothing (no such rollouts), but is kept in its place
        assert await actor.prefetch.remote([f"nobody{i}-r0"]) == 0
    finalized = await pool.submit(request)
    assert finalized.metrics["staging/read_ahead_keys"] == 0.0  # read with the request


async def test_a_bundles_groups_are_delivered_together(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    groups = [await _staged_group(sink, g, ["ok"]) for g in _same_slot(pool, "together", 3)]
    async with pool.as_completed([request for request, _ in groups]) as results:
        first = await results.receive()
        rest = [results.receive_nowait(), results.receive_nowait()]  # no wait: already in
        with pytest.raises(anyio.EndOfStream):
            await results.receive()
    assert sorted(f.group_id for f in [first, *rest]) == sorted(r.group_id for r, _ in groups)


async def test_a_bundle_whose_actor_dies_before_its_publish_is_redone_group_by_group(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    groups = [
        await _staged_group(sink, g, ["ok", "ok"]) for g in _same_slot(pool, "stall-before-b", 2)
    ]
    requests = [request for request, _ in groups]
    deaths, retries = pool.stats["actor_deaths"], pool.stats["retries"]
    result: list[FinalizedGroup] = []

    async def run() -> None:
        result.extend(await pool.map(requests))

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            while any([await pool.record(r.group_id) is None for r in requests]):
                await anyio.sleep(0.05)
            ray.kill(pool.actor_for(requests[0].group_id), no_restart=True)
    assert pool.stats["actor_deaths"] == deaths + 1
    assert pool.stats["retries"] == retries + 2  # each group alone on the replacement
    for (request, staged), finalized in zip(groups, result, strict=True):
        expected = _in_process(request, staged)
        assert finalized.outcome == "published"
        assert await _held(sink, request.group_id) == (sorted(expected.rows), [])
        assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())


async def test_256_groups_through_2_workers_match_in_process_reassembly(
    sink: ActorSink, pool: ReassemblerPool
) -> None:
    pattern = ["ok", "forest", "ok", "poisoned", "tampered", "missing"]
    groups = [
        make_group(f"g{i:03d}", [pattern[(i + j) % 6] for j in range(4)], seed=i)
        for i in range(256)
    ]
    await sink.put([c for _, staged in groups for c in staged.values()])
    requests = [request for request, _ in groups]
    with anyio.fail_after(120):
        seen = []
        async with pool.as_completed(requests) as results:
            async for finalized in results:
                seen.append(finalized.group_id)
        assert sorted(seen) == sorted(r.group_id for r in requests)
        in_order = await pool.map(requests)  # retries of finished groups: same results
    expected_rows: dict[str, Any] = {}
    for (request, staged), finalized in zip(groups, in_order, strict=True):
        expected = _in_process(request, staged)
        assert finalized.group_id == request.group_id
        assert finalized.training_keys == expected.finalized.training_keys
        assert _core_metrics(finalized) == _core_metrics(expected.finalized)
        expected_rows.update(expected.rows)
    keys = sorted(expected_rows)
    assert sorted(k for k in await sink.row_keys() if k[0] == "g") == keys
    assert await sink.fetch(keys) == [expected_rows[k] for k in keys]
    assert [k for k in await sink.staged_keys() if k[0] == "g"] == []
    step = step_metrics(in_order)
    assert step["groups/total"] == 256.0
    assert step["rows/total"] == float(len(keys))


async def test_the_in_process_baseline_runs_the_core_on_a_memory_sink() -> None:
    """What the pool is compared with: the core on a `MemorySink`, in one process."""
    request, staged = make_group("local", ["ok", "missing"])
    sink = MemorySink()
    await sink.put(list(staged.values()))
    result = _in_process(request, dict(zip(staged, await sink.get(list(staged)), strict=True)))
    assert result.finalized.failures == (("local-r1", "missing_rows"),)
