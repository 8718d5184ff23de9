"""The driver's event-loop watchdog names what blocked the loop (`tokcap.loop.LagWatch`)."""

from __future__ import annotations

import time

import anyio

from tokcap.loop import LagWatch


def _a_blocking_call_on_the_loop() -> None:
    time.sleep(0.6)  # what a synchronous clear or decode does to the loop


def test_a_stall_names_the_blocking_frame_and_is_logged() -> None:
    logged: list[str] = []
    watch = LagWatch(stall_ms=100.0, sample_s=0.01, log=logged.append)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run)
            await anyio.sleep(0.05)
            _a_blocking_call_on_the_loop()
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

    anyio.run(main)
    (stall,) = watch.stalls
    assert stall.samples > 0
    assert not stall.starved
    assert any("_a_blocking_call_on_the_loop" in frame for frame in stall.stack)
    assert watch.run_ms == stall.lag_ms >= 100.0
    (line,) = logged
    assert "_a_blocking_call_on_the_loop" in line


def test_a_loop_that_waited_in_its_selector_was_starved_not_blocked() -> None:
    watch = LagWatch(keep=2)
    idle = ("asyncio/base_events.py:1 _run_once", "selectors.py:468 select")
    busy = ("asyncio/base_events.py:1 _run_once", "tokcap/x.py:3 decode")
    assert watch.record(300.0, [idle, idle]).starved
    blocked = watch.record(500.0, [idle, busy, busy])
    assert (blocked.starved, blocked.stack, blocked.samples) == (False, busy, 3)
    assert "tokcap/x.py:3 decode" in blocked.culprit()
    watch.record(100.0, [])  # the sampler saw nothing: kept, not called starved
    assert [s.lag_ms for s in watch.stalls] == [500.0, 300.0]
    assert (watch.stall_count, watch.stalls[1].culprit().endswith("loop idle")) == (3, True)
