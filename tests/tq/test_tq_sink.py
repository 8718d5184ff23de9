"""TQSink on real TQ: what TQ alone gets wrong, cancellation, loop lag, loopback."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.procs import descendants
from tests.tq.support import fresh_tq_sink, loop_turns_during
from tokcap_core import MissingRows, SinkError, StagedCall
from tokcap_core.simulate import simulate_rollout

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("tq_cluster")]


def _calls(prefix: str, rollouts: int, *, routes: bool = False) -> list[StagedCall]:
    return [
        c
        for i in range(rollouts)
        for c in simulate_rollout(f"{prefix}{i}", seed=i, turns=2, routes=routes).calls
    ]


@pytest.mark.anyio
async def test_routes_dtype_survives_the_int16_staging_column() -> None:
    import transfer_queue as tq

    sink = fresh_tq_sink()
    calls = [c for c in _calls("rt", 4, routes=True) if c.routes is not None]
    assert calls
    await sink.put(calls)
    raw = await tq.async_kv_batch_get(
        keys=[c.key for c in calls], partition_id=sink.config.staging_partition
    )
    assert str(raw["routes"].dtype) == "torch.int16"
    got = await sink.get([c.key for c in calls])
    assert [c.routes for c in got] == [c.routes for c in calls]
    assert all(c.compute_digest() == c.digest for c in got)


@pytest.mark.anyio
async def test_rows_with_other_fields_are_an_error_not_fewer_fields() -> None:
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict

    sink = fresh_tq_sink()
    calls = _calls("fields", 1)
    await sink.put(calls)
    tokens = torch.nested.as_nested_tensor(
        [torch.arange(3, dtype=torch.int32)], layout=torch.jagged
    )
    await tq.async_kv_batch_put(
        keys=["fields9/odd"],
        partition_id=sink.config.staging_partition,
        fields=TensorDict({"tokens": tokens}, batch_size=[1]),
    )
    with pytest.raises(SinkError) as info:
        await sink.get([calls[0].key, "fields9/odd"])
    assert info.value.code == "field_mismatch"


async def _stored(prefix: str, rollouts: int) -> tuple[Any, list[StagedCall], list[str]]:
    """A fresh sink holding ``rollouts`` simulated rollouts' calls: the sink, calls, keys."""
    sink = fresh_tq_sink()
    calls = _calls(prefix, rollouts)
    await sink.put(calls)
    return sink, calls, [c.key for c in calls]


async def _clear_cancelled(sink: Any, keys: list[str]) -> None:
    with anyio.move_on_after(0) as scope:
        await sink.clear(keys)
    assert scope.cancelled_caught


@pytest.mark.anyio
async def test_a_cancelled_clear_still_frees_every_key() -> None:
    sink, calls, keys = await _stored("cancel", 40)

    await _clear_cancelled(sink, keys)

    # Never half: every key is either gone or fully readable ...
    for call in calls:
        outcome: object
        try:
            outcome = await sink.get([call.key])
        except MissingRows as e:
            outcome = e.missing
        assert outcome in ([call], (call.key,))
    # ... and because the clear is shielded, all of them are gone.
    with pytest.raises(MissingRows) as info:
        await sink.get(keys)
    assert set(info.value.missing) == set(keys)
    assert await sink.staged_keys() == []


@pytest.mark.anyio
async def test_cancelling_the_task_mid_clear_frees_every_key() -> None:
    sink, _, keys = await _stored("midclear", 40)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sink.clear, keys)
        await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    assert await sink.staged_keys() == []


@pytest.mark.anyio
async def test_clear_lets_the_loop_run_other_tasks_where_the_sync_veneer_stops_it() -> None:
    import transfer_queue as tq

    sink = fresh_tq_sink()
    partition = sink.config.staging_partition
    calls = _calls("lag", 1000)  # 2,000 staged calls
    keys = [c.key for c in calls]
    assert len(keys) == 2000

    await sink.put(calls)

    async def ours() -> None:
        await sink.clear(keys)

    turns_ours = await loop_turns_during(ours)
    await sink.put(calls)

    async def sync_on_loop() -> None:
        tq.kv_clear(keys=keys, partition_id=partition)  # the blocking veneer, on purpose

    turns_sync = await loop_turns_during(sync_on_loop)
    assert await sink.staged_keys() == []
    assert (turns_sync, turns_ours > 0) == (0, True), (turns_sync, turns_ours)


@pytest.mark.anyio
async def test_clear_never_touches_the_sync_veneer(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer_queue as tq

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sync kv_clear ran")

    monkeypatch.setattr(tq, "kv_clear", refuse)
    monkeypatch.setattr(tq.interface, "kv_clear", refuse)
    sink = fresh_tq_sink()
    calls = _calls("nosync", 3)
    await sink.put(calls)
    await sink.clear([c.key for c in calls])
    assert await sink.staged_keys() == []


def test_every_listening_socket_of_ray_and_tq_is_loopback() -> None:
    ours = descendants(os.getpid())
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    owned = []
    for line in listing.splitlines():
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if pids & ours:
            owned.append(line.split()[3])
    assert len(owned) >= 5, listing  # GCS, raylet, driver, TQ controller, storage unit at least
    loopback = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")
    assert [a for a in owned if not loopback.match(a)] == []


def test_a_second_local_tq_in_the_same_process_is_refused(tmp_path: Path) -> None:
    from tokcap_tq import local_tq

    with pytest.raises(SinkError) as info, local_tq(tmp_path):
        pass
    assert info.value.code == "ray_running"


def test_ray_temp_dir_is_short_enough_for_unix_sockets(tq_cluster: Any) -> None:
    assert len(str(tq_cluster.temp_dir)) <= 40
    assert tq_cluster.free_cpus == 2
