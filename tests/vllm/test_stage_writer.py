"""The gate's batched sink writes (`StageWriter`), without an engine: real staged calls of
synthetic rollouts, the real `MemorySink`, wrapped to hold or refuse puts where a test says.

The laws: up to `WRITERS` puts run at once, and calls that finish while they are all in
flight go together in the next put; a lone call is written at once; a row the sink
refuses fails only its own call; a put that times out fails every call it held; every
call's ``sink_done`` is set once its answer is known, and calls left when the gate stops
are not served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
from anyio.abc import TaskGroup
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap_core import MemorySink, SinkError, StagedCall
from tokcap_core.ledger import Ledger
from tokcap_core.testing import staged_calls
from tokcap_vllm.gate._records import GateCall, RolloutRecord
from tokcap_vllm.gate._stage_writer import WRITERS, StageWriter


class HeldSink(MemorySink):
    """The real `MemorySink`; each put waits for ``release`` (never set: it hangs), and a
    put holding a row of a rollout in ``refuse`` is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.release: anyio.Event | None = None
        self.puts: list[int] = []
        self.refuse: set[str] = set()

    async def put(self, calls: Sequence[StagedCall]) -> None:
        self.puts.append(len(calls))
        if self.release is not None:
            await self.release.wait()
        if any(c.rollout_id in self.refuse for c in calls):
            raise SinkError("injected_refusal", "this test sink refuses that rollout")
        await super().put(calls)


def _distinct(n: int) -> st.SearchStrategy[list[StagedCall]]:
    return st.lists(staged_calls(), min_size=n, max_size=n, unique_by=lambda c: c.rollout_id)


def _gate_calls(staged: list[StagedCall]) -> list[GateCall]:
    out = []
    for s in staged:
        record = RolloutRecord(s.rollout_id, Ledger(s.rollout_id), anyio.Lock())
        call = GateCall(rollout=record, kind="chat", sink_done=anyio.Event(), settled=anyio.Event())
        call.staged = s
        out.append(call)
    return out


async def _write_while_first_held(
    sink: HeldSink, staged: list[StagedCall]
) -> tuple[list[GateCall], list[int]]:
    """Queue the first call, the rest while its put is held; release; wait for all."""
    calls = _gate_calls(staged)
    told: list[int] = []

    async def written(batch: list[GateCall], seconds: float) -> None:
        told.append(len(batch))

    sink.release = anyio.Event()
    writer = StageWriter(sink, 30.0, written)
    async with anyio.create_task_group() as tg:
        writer.write(calls[0], tg)
        await anyio.wait_all_tasks_blocked()
        for call in calls[1:]:
            writer.write(call, tg)
        sink.release.set()
        for call in calls:
            await call.sink_done.wait()
    return calls, told


FEW = settings(max_examples=5, deadline=None)


@given(staged=_distinct(3))
@FEW
def test_calls_that_finish_during_a_put_go_together_in_the_next(staged: list[StagedCall]) -> None:
    sink = HeldSink()
    calls, told = anyio.run(_write_while_first_held, sink, staged)
    assert sink.puts == [1, 2]  # the first at once, the two that waited in one put
    assert told == [1, 2]  # the observers hear every call
    assert [call.stage_error for call in calls] == [None] * 3
    assert anyio.run(sink.get, [s.key for s in staged]) == staged


@given(staged=_distinct(WRITERS + 2))
@FEW
def test_calls_that_finish_while_every_writer_is_busy_go_together(
    staged: list[StagedCall],
) -> None:
    """Each of the first `WRITERS` calls gets a put of its own at once (the last call of a
    burst does not wait for the put before it); the calls after them wait, in one put."""
    sink = HeldSink()
    calls = _while_writers_busy(sink, staged, lambda tg: sink.release.set())
    assert sink.puts == [1] * WRITERS + [2]
    assert [call.stage_error for call in calls] == [None] * len(staged)
    assert anyio.run(sink.get, [s.key for s in staged]) == staged


@given(staged=_distinct(4))
@FEW
def test_a_refused_row_fails_only_its_own_call(staged: list[StagedCall]) -> None:
    sink = HeldSink()
    sink.refuse.add(staged[2].rollout_id)
    calls, _ = anyio.run(_write_while_first_held, sink, staged)
    assert sink.puts == [1, 3, 1, 1, 1]  # the batch was refused: each call alone again
    assert [call.stage_error for call in calls] == [None, None, "injected_refusal", None]
    kept = [s for s in staged if s.rollout_id not in sink.refuse]
    assert anyio.run(sink.get, [s.key for s in kept]) == kept


@given(staged=_distinct(2))
@FEW
def test_a_put_that_times_out_fails_every_call_it_held(staged: list[StagedCall]) -> None:
    sink = HeldSink()

    async def main() -> list[GateCall]:
        calls = _gate_calls(staged)
        sink.release = anyio.Event()  # never set: the put hangs until its timeout
        writer = StageWriter(sink, 0.01, _ignore)
        async with anyio.create_task_group() as tg:
            for call in calls:
                writer.write(call, tg)
        return calls

    calls = anyio.run(main)
    assert sink.puts == [2]  # the sink is at fault, not a row: no call-by-call retry
    assert [call.stage_error for call in calls] == ["timeout", "timeout"]


@given(staged=_distinct(WRITERS + 1))
@FEW
def test_calls_left_when_the_gate_stops_are_not_served(staged: list[StagedCall]) -> None:
    """The gate's task group is cancelled while every writer's put is held and a call is
    queued: all are done with ``gate_not_serving``, so nothing waits on them and nothing
    commits them."""
    sink = HeldSink()
    calls = _while_writers_busy(sink, staged, lambda tg: tg.cancel_scope.cancel())
    assert [call.stage_error for call in calls] == ["gate_not_serving"] * len(staged)
    assert all(call.sink_done.is_set() for call in calls)


def _while_writers_busy(
    sink: HeldSink, staged: list[StagedCall], then: Callable[[TaskGroup], object]
) -> list[GateCall]:
    """Write the first `WRITERS` calls one by one, each until its put is held in ``sink``,
    queue the rest while every writer is busy, then ``then(task_group)``; the calls."""

    async def main() -> list[GateCall]:
        calls = _gate_calls(staged)
        sink.release = anyio.Event()
        writer = StageWriter(sink, 30.0, _ignore)
        async with anyio.create_task_group() as tg:
            for call in calls[:WRITERS]:
                writer.write(call, tg)
                await anyio.wait_all_tasks_blocked()
            for call in calls[WRITERS:]:
                writer.write(call, tg)
            then(tg)
        return calls

    return anyio.run(main)


async def _ignore(batch: list[GateCall], seconds: float) -> None:
    return None
