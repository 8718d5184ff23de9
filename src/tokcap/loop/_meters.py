"""Where a run's time goes: how busy the engine was kept, and what CPU the run burned.

- `BusyMeter`: the harness counts its calls in flight; the meter integrates that count over
  time, so a step can say for how many seconds at least one call was in the engine
  (``engine_busy``) and how many were in flight on average (``in_flight``: the engine's
  batch, roughly). On this CPU engine a step's throughput grows with its batch.
- `CpuMeter`: CPU seconds (user + system) used by this process and every process under it
  (the engine core, Ray's raylet and workers, TransferQueue's actors), read between steps
  in a worker thread: on a 2-core box the CPU per trained sample, and how close a run comes
  to 2 CPU-seconds per second, bound what overlapping generation and training can gain.

`Meters` holds both, and the event loop's `tokcap.loop._watchdog.LagWatch`, for the loop:
`Meters.watching` runs them around the steps and `Meters.take` reads a step's window.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import anyio
import psutil

from ._watchdog import LagWatch

__all__ = ["BusyMeter", "CpuMeter", "Meters"]


class BusyMeter:
    """Calls in flight, integrated over time; `take` gives a window's figures."""

    def __init__(self) -> None:
        self._count = 0
        self._last = time.perf_counter()
        self._busy_s = 0.0
        self._area = 0.0
        self._window_start = self._last

    def _advance(self) -> None:
        now = time.perf_counter()
        if self._count:
            self._busy_s += now - self._last
            self._area += self._count * (now - self._last)
        self._last = now

    def enter(self) -> None:
        """A call went out."""
        self._advance()
        self._count += 1

    def leave(self) -> None:
        """A call came back (or failed)."""
        self._advance()
        self._count -= 1

    def take(self) -> dict[str, float]:
        """Since the last take: ``engine_busy`` (seconds with a call in flight),
        ``in_flight`` (calls in flight on average over those seconds) and ``window`` (the
        seconds since the last take: a step's share of the run's wall clock, between-step
        work included)."""
        self._advance()
        busy, area, window = self._busy_s, self._area, self._last - self._window_start
        self._busy_s = self._area = 0.0
        self._window_start = self._last
        return {"engine_busy": busy, "in_flight": area / busy if busy else 0.0, "window": window}


class CpuMeter:
    """CPU seconds of this process tree since the last `take`, by role (read with psutil)."""

    def __init__(self) -> None:
        self._seen: dict[int, float] = {}

    def _read(self) -> dict[str, float]:
        """CPU time each process used since it was last read, summed by role (a process
        that exited in between loses its last interval: its reading went with it)."""
        used = {"cpu": 0.0, "cpu_engine": 0.0, "cpu_driver": 0.0}
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()  # all its threads, not its children
                engine = proc.pid != me.pid and _is_engine(proc)
            except psutil.Error:  # gone meanwhile
                continue
            cpu = times.user + times.system
            delta = cpu - self._seen.get(proc.pid, 0.0)
            self._seen[proc.pid] = cpu
            used["cpu"] += delta
            if proc.pid == me.pid:
                used["cpu_driver"] += delta
            elif engine:
                used["cpu_engine"] += delta
        return used

    async def start(self) -> None:
        """Take the baseline (the CPU spent before the first step is not counted)."""
        await anyio.to_thread.run_sync(self._read)

    async def take(self) -> dict[str, float]:
        """Since the last take (or `start`): ``cpu`` (the whole tree), ``cpu_engine`` (vLLM's
        engine core), ``cpu_driver`` (this process: trainer, gate, API server, pumps)."""
        return await anyio.to_thread.run_sync(self._read)


class Meters:
    """A run's meters: the event loop's lag (``lag``, its stalls sent to ``log``), the
    engine's calls in flight (``busy``, counted by the harness) and the CPU (``cpu``)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.lag = LagWatch(log=log)
        self.busy = BusyMeter()
        self.cpu = CpuMeter()

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[Meters]:
        """Watch the loop's lag and start each meter's first window; at the end, log the
        lag's summary over the run."""
        async with anyio.create_task_group() as watch:
            watch.start_soon(self.lag.run)
            await self.cpu.start()
            self.busy.take()
            yield self
            watch.cancel_scope.cancel()
        if self.lag.log is not None:
            self.lag.log(self.lag.summary())

    async def take(self) -> dict[str, float]:
        """Since the last take: the engine's busy figures (`BusyMeter.take`) and the CPU's
        (`CpuMeter.take`), a step's ``seconds`` beside its stages."""
        busy = self.busy.take()
        return {**busy, **(await self.cpu.take())}


def _is_engine(proc: psutil.Process) -> bool:
    """vLLM's engine core (it names its process ``VLLM::EngineCore``)."""
    return any("EngineCore" in arg for arg in proc.cmdline())
