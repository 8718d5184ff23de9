"""TQSink's contract where TQ's own calls leave gaps: how many round trips a put and a get
make, writers racing on one key, keys registered but never written, a stalled controller.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest

from tests.procs import process_table
from tests.tq.support import fresh_tq_sink
from tokcap_core import MissingRows, SinkError, StagedCall
from tokcap_core.provenance import VersionSpan
from tokcap_core.simulate import simulate_rollout

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.usefixtures("tq_cluster")]


def _calls(prefix: str, rollouts: int) -> list[StagedCall]:
    return [
        c for i in range(rollouts) for c in simulate_rollout(f"{prefix}{i}", seed=i, turns=2).calls
    ]


class _Spy:
    """Records the TQ client calls a sink makes (the real client still answers them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import transfer_queue as tq

        self.calls: list[str] = []
        client = tq.get_client()
        for name in ("async_kv_retrieve_meta", "async_put", "async_get_data"):
            monkeypatch.setattr(client, name, self._wrap(name, getattr(client, name)))
        # The spy's labels: a registration, a lookup, a write, a read, a listing.
        monkeypatch.setattr(tq, "async_kv_list", self._wrap("kv_list", tq.async_kv_list))

    def _wrap(self, name: str, real: Any) -> Any:
        async def spy(*args: Any, **kwargs: Any) -> Any:
            label = name.removeprefix("async_")
            if name == "async_kv_retrieve_meta":
                label = "register" if kwargs["create"] else "lookup"
            self.calls.append(label)
            return await real(*args, **kwargs)

        return spy

    def take(self) -> list[str]:
        taken, self.calls = self.calls, []
        return taken


async def test_a_put_and_a_get_make_the_round_trips_raw_tq_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = fresh_tq_sink()
    calls = _calls("trips", 3)
    keys = [c.key for c in calls]
    spy = _Spy(monkeypatch)

    await sink.put(calls)
    assert spy.take() == ["register", "put"]  # what tq.async_kv_batch_put does

    assert await sink.get(keys) == calls
    assert spy.take() == ["lookup", "get_data"]  # what tq.async_kv_batch_get does

    await sink.put(calls)  # a retry: the held rows are read back and compared, not rewritten
    assert spy.take() == ["register", "lookup", "get_data"]

    with pytest.raises(MissingRows):
        await sink.get([*keys, "absent0/c000001"])
    assert spy.take() == ["lookup", "kv_list", "lookup", "get_data"]


async def test_writers_racing_on_one_key_in_one_process_take_turns() -> None:
    sink = fresh_tq_sink()
    (first, *_) = _calls("race", 1)
    bumped = first.weight_version + 1
    spans = (VersionSpan(version=bumped, start=0, end=first.gen_len),)
    rival = dataclasses.replace(
        first,
        weight_version=bumped,
        weight_version_last=bumped,
        weight_versions=spans,
        kv_versions=spans,
    )
    outcomes: dict[int, str] = {}

    async def write(index: int, call: StagedCall) -> None:
        try:
            await sink.put([call])
            outcomes[index] = "ok"
        except SinkError as e:
            outcomes[index] = e.code

    async with anyio.create_task_group() as tg:
        tg.start_soon(write, 0, first)
        tg.start_soon(write, 1, rival)
        tg.start_soon(write, 2, first)
    (stored,) = await sink.get([first.key])
    winner = first if stored == first else rival
    assert stored == winner
    # Whoever lost to the winner was refused; every put of the winner's content succeeded.
    for index, call in ((0, first), (1, rival), (2, first)):
        assert outcomes[index] == ("ok" if call == winner else "conflicting_put")


async def test_a_key_registered_but_never_written_reads_as_missing_and_can_be_written() -> None:
    import transfer_queue as tq

    sink = fresh_tq_sink()
    written, orphan = _calls("orphan", 2)[:2]
    await sink.put([written])
    # A writer that registered its key and died before writing (what TQ's own put does first).
    await tq.get_client().async_kv_retrieve_meta(
        keys=[orphan.key], partition_id=sink.config.staging_partition, create=True
    )
    assert sorted(await sink.staged_keys()) == sorted([written.key, orphan.key])

    with pytest.raises(MissingRows) as info:
        await sink.get([written.key, orphan.key])
    assert info.value.missing == (orphan.key,)

    await sink.put([orphan])  # not held: written now, not compared
    assert await sink.get([written.key, orphan.key]) == [written, orphan]


async def test_a_refused_put_leaves_none_of_its_new_keys_registered() -> None:
    sink = fresh_tq_sink()
    held, new = _calls("refused", 2)[:2]
    await sink.put([held])
    changed = dataclasses.replace(held, finish_reason="length")
    with pytest.raises(SinkError) as info:
        await sink.put([new, changed])
    assert info.value.code == "conflicting_put"
    assert await sink.staged_keys() == [held.key]
    assert await sink.get([held.key]) == [held]


def _controller_pid() -> int:
    """This session's TQ controller: a descendant of this process titled
    ``ray::TransferQueueController`` (other Rays on the machine are not ours to stop)."""
    processes = process_table()
    ours = []
    for pid, (_, title) in processes.items():
        if title.startswith(b"ray::TransferQueueController"):
            parent = pid
            while parent in processes and parent != os.getpid():
                parent = processes[parent][0]
            if parent == os.getpid():
                ours.append(pid)
    # more than one: which one this sink talks to is unknown, and stopping another proves nothing
    assert len(ours) == 1, f"TransferQueueController processes under this one: {ours}"
    return ours[0]


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """A controller that stops answering (SIGSTOP), resumed on exit whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_every_operation_fails_with_tq_timeout_on_a_stalled_controller() -> None:
    sink = fresh_tq_sink(op_timeout_s=1.0)
    calls, more = _calls("stall", 1), _calls("stall-more", 1)
    await sink.put(calls)
    keys = [c.key for c in calls]
    operations = {
        "staged_keys": sink.staged_keys,
        "row_keys": sink.row_keys,
        "get": lambda: sink.get(keys),
        "put": lambda: sink.put(more),
        "clear": lambda: sink.clear(keys),
    }
    codes = {}
    with _stopped(_controller_pid()):
        for name, operation in operations.items():
            with anyio.fail_after(10):  # hang guard: the sink's own deadline is 1 s
                try:
                    await operation()
                    codes[name] = "ok"
                except SinkError as e:
                    codes[name] = e.code
    assert codes == dict.fromkeys(operations, "tq_timeout")
    # The controller answers again, and the sink with it (the timed-out put may have
    # registered its keys once the controller resumed: a clear frees them, as documented).
    await anyio.sleep(0.5)
    with anyio.fail_after(30):
        await sink.clear(keys + [c.key for c in more])
        assert await sink.staged_keys() == []
