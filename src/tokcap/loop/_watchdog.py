"""A watchdog of the driver's event loop: how late a short sleep wakes up, and who made it late.

The loop's pumps, the control-plane client and TransferQueue's async calls share one event
loop; anything that blocks it (a synchronous clear, a large decode) delays all of them.
`LagWatch.run` sleeps ``tick_s`` again and again and keeps the largest overshoot; the
driver takes the window's maximum after each step (`take`).

A lag alone does not say what to fix, so while `run` watches, a sampling thread looks at
the loop every ``sample_s``: when the loop has not woken for ``stall_ms`` past its tick, it
records the loop thread's Python stack (``sys._current_frames``) until the loop wakes
again. Each such stall becomes a `Stall` naming its most sampled stack (the culprit),
logged through ``log`` when it ends; `stalls` keeps the worst. A stall whose samples all
show the loop thread inside the selector's wait was not blocked by the loop's own code:
the thread was ready but did not run (another thread held the GIL, or the box's CPUs were
busy elsewhere): `Stall.starved`.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import anyio

__all__ = ["LagWatch", "Stall"]

_IDLE_FRAMES = ("select", "poll")
"""Leaf functions of a loop thread that waits in its selector for I/O or timers."""


@dataclass(frozen=True, slots=True)
class Stall:
    """One time the event loop woke ``lag_ms`` late: the loop thread's most sampled stack
    (outermost first, ``file:line function``) over ``samples`` samples."""

    lag_ms: float
    stack: tuple[str, ...]
    samples: int
    starved: bool
    """Every sample showed the loop waiting in its selector: starved (GIL or CPU), not
    blocked by its own code."""

    def culprit(self) -> str:
        """One line: the stall and the innermost frames of its stack."""
        where = (
            "starved (GIL or CPU), loop idle"
            if self.starved
            else " <- ".join(reversed(self.stack[-4:]))
        )
        return f"event loop stalled {self.lag_ms:.0f} ms ({self.samples} samples): {where}"


class LagWatch:
    """The largest event-loop lag (ms) seen since the last `take`, and over the run; the
    worst stalls over ``stall_ms`` with their culprit (see the module)."""

    def __init__(
        self,
        tick_s: float = 0.01,
        *,
        stall_ms: float = 200.0,
        sample_s: float = 0.02,
        keep: int = 5,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.tick_s = tick_s
        self.stall_ms = stall_ms
        self.sample_s = sample_s
        self.keep = keep
        self.log = log
        self.window_ms = 0.0
        self.run_ms = 0.0
        self.stalls: list[Stall] = []
        """The worst stalls of the run (at most ``keep``), worst first."""
        self.stall_count = 0
        self._beat = time.perf_counter()
        self._samples: list[tuple[str, ...]] = []

    def note(self, lag_ms: float) -> None:
        """Record one observed lag."""
        self.window_ms = max(self.window_ms, lag_ms)
        self.run_ms = max(self.run_ms, lag_ms)

    def take(self) -> float:
        """The window's largest lag (ms), starting a new window."""
        lag, self.window_ms = self.window_ms, 0.0
        return lag

    def record(self, lag_ms: float, samples: list[tuple[str, ...]]) -> Stall:
        """A stall of ``lag_ms`` from the loop thread's sampled stacks: kept if among the
        worst, logged."""
        stack = Counter(samples).most_common(1)[0][0] if samples else ()
        starved = bool(samples) and all(_idle(s) for s in samples)
        stall = Stall(lag_ms=lag_ms, stack=stack, samples=len(samples), starved=starved)
        self.stall_count += 1
        self.stalls = sorted([*self.stalls, stall], key=lambda s: -s.lag_ms)[: self.keep]
        if self.log is not None:
            self.log(f"[tokcap] {stall.culprit()}")
        return stall

    async def run(self) -> None:
        """Watch until cancelled (with the sampling thread while it runs)."""
        stop = threading.Event()
        sampler = threading.Thread(
            target=self._sample,
            args=(threading.get_ident(), stop),
            name="tokcap-lag-sampler",
            daemon=True,
        )
        self._beat = time.perf_counter()
        sampler.start()
        try:
            while True:
                start = time.perf_counter()
                self._beat = start
                await anyio.sleep(self.tick_s)
                woke = time.perf_counter()
                lag_ms = max(0.0, (woke - start - self.tick_s) * 1e3)
                self._beat = woke
                samples, self._samples = self._samples, []
                self.note(lag_ms)
                if lag_ms >= self.stall_ms:
                    self.record(lag_ms, samples)
        finally:
            stop.set()
            sampler.join()

    def _sample(self, loop_thread: int, stop: threading.Event) -> None:
        """The sampling thread: the loop thread's stack whenever the loop is late."""
        while not stop.wait(self.sample_s):
            late_ms = (time.perf_counter() - self._beat - self.tick_s) * 1e3
            if late_ms < self.stall_ms:
                continue
            frame = sys._current_frames().get(loop_thread)
            if frame is not None:
                self._samples.append(_stack(frame))


def _stack(frame: object) -> tuple[str, ...]:
    summary = traceback.extract_stack(frame)  # type: ignore[arg-type]
    return tuple(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in summary)


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _idle(stack: tuple[str, ...]) -> bool:
    return bool(stack) and stack[-1].rsplit(" ", 1)[-1] in _IDLE_FRAMES
