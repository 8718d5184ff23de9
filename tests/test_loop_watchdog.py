"""The driver's event-loop watchdog names what blocked the loop (`tokcap.loop.LagWatch`)."""

from __future__ import annotations

import threading
import time

import anyio

from tokcap.loop import LagWatch


def _a_blocking_call_on_the_loop() -> None:
    time.sleep(0.6)  # what a synchronous clear or decode does to the loop


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))  # Python work in another thread: it takes the GIL in turns


def test_a_stall_names_the_blocking_frame_and_is_logged() -> None:
    logged: list[str] = []
    watch = LagWatch(stall_ms=100.0, sample_s=0.01, log=logged.append)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run)
            await anyio.sleep(0.05)
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop,), name="spinner")
            spinner.start()
            try:
                _a_blocking_call_on_the_loop()
            finally:
                stop.set()
                spinner.join()
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

    anyio.run(main)
    (stall,) = watch.stalls
    assert stall.samples > 0
    assert any("_a_blocking_call_on_the_loop" in frame for frame in stall.stack)
    assert watch.run_ms == stall.lag_ms >= 100.0
    assert any(other.startswith("spinner: ") and "_spin" in other for other in stall.others)
    (line,) = logged
    assert "_a_blocking_call_on_the_loop" in line


def test_a_stall_s_cause_follows_the_cpu_the_loop_and_the_process_got() -> None:
    logged: list[str] = []
    watch = LagWatch(keep=2, log=logged.append)
    busy = ("asyncio/base_events.py:1 _run_once", "tokcap/x.py:3 decode")
    blocked = watch.record(300.0, [busy, busy], loop_cpu_ms=290.0, process_cpu_ms=300.0)
    assert (blocked.cause, blocked.stack, blocked.samples) == ("blocked", busy, 2)
    assert "tokcap/x.py:3 decode" in blocked.culprit()
    gil = watch.record(500.0, [], loop_cpu_ms=20.0, process_cpu_ms=450.0)
    assert (gil.cause, gil.stack) == ("gil", ())
    idle = ("asyncio/base_events.py:1 _run_once", "selectors.py:468 select")
    assert watch.record(100.0, [idle], loop_cpu_ms=5.0, process_cpu_ms=10.0).cause == "cpu"
    assert [s.lag_ms for s in watch.stalls] == [500.0, 300.0]
    # a stall the sampler saw at leisure in one call: a blocking call, on the CPU or not
    assert watch.record(260.0, [busy] * 3, loop_cpu_ms=1.0).cause == "blocked"
    # many small calls, the loop on the CPU half the time and the process all of it: the
    # loop waited its turn for the GIL
    other = ("asyncio/base_events.py:1 _run_once", "uuid.py:723 uuid4")
    shared = watch.record(400.0, [busy, other], loop_cpu_ms=190.0, process_cpu_ms=380.0)
    assert shared.cause == "gil"
    # one sample of a stall just over the threshold says nothing: the process hardly ran
    assert watch.record(230.0, [busy], loop_cpu_ms=10.0, process_cpu_ms=20.0).cause == "cpu"
    assert watch.causes == {"blocked": 2, "gil": 2, "cpu": 2}
    assert len(logged) == 3  # the worst so far, and every one the loop caused
    assert "worst: event loop stalled 500 ms (gil): no sample" in watch.summary()
