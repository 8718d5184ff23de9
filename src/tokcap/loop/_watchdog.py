"""A watchdog of the driver's event loop: how late a short sleep wakes up, and who made it late.

The loop's pumps, the control-plane client and TransferQueue's async calls share one event
loop; anything that blocks it (a synchronous clear, a large decode) delays all of them.
`LagWatch.run` sleeps ``tick_s`` again and again and keeps the largest overshoot; the
driver takes the window's maximum after each step (`take`).

A lag alone does not say what to fix, so while `run` watches, a sampling thread looks at
the loop every ``sample_s``: when the loop has not woken for ``stall_ms`` past its tick, it
records the loop thread's Python stack (``sys._current_frames``) until the loop wakes
again. Each such stall becomes a `Stall` naming its most sampled stack and the CPU time
the loop thread and the whole process got meanwhile; a stall that is the run's worst so
far, or one the loop's own work caused, is logged through ``log``; `stalls` keeps the
worst. The CPU times say who is to
blame when the stack does not: a loop thread the sampler saw (at leisure) in one call for
most of the stall, or one on the CPU for most of it, was busy with its own work
(``blocked``: the stack names it); one that got part of the CPU while the process got
much waited its turn for the GIL other threads held (``gil``: `Stall.others` names them);
a process that got little CPU was starved by the box (``cpu``: other processes on its
cores).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio

__all__ = ["LagWatch", "Stall"]

Cause = Literal["blocked", "gil", "cpu"]

_BUSY = 0.5
"""A process on the CPU, or a call sampled, for at least this share of a stall held it."""
_MIN_SEEN = 3
"""Fewer samples of one call than this say nothing (a stall just over the threshold)."""
_OWN = 0.8
"""A loop thread on the CPU for this share of a stall was busy with its own work."""


@dataclass(frozen=True, slots=True)
class Stall:
    """One time the event loop woke ``lag_ms`` late: the loop thread's most sampled stack
    (outermost first, ``file:line function``; empty: the sampler never ran), and the CPU
    time the loop thread and the process got during the stall."""

    lag_ms: float
    stack: tuple[str, ...]
    samples: int
    loop_cpu_ms: float
    process_cpu_ms: float
    expected: int = 1
    """The samples a sampler that ran freely would have taken."""
    stack_samples: int = 0
    """The samples that showed ``stack``."""
    others: tuple[str, ...] = ()
    """The process's other threads seen outside a wait during the stall (``thread: file:line
    function``, most often seen first): who may have held the GIL."""

    @property
    def cause(self) -> Cause:
        """``blocked`` (the loop's own work: one call seen in at least half the samples a
        free sampler takes, or the loop thread on the CPU for most of the stall), ``gil``
        (the process ran, the loop waited its turn) or ``cpu`` (the process did not run)."""
        seen = self.stack_samples >= max(_MIN_SEEN, _BUSY * self.expected)
        if self.stack and not _idle(self.stack) and seen:
            return "blocked"
        if self.loop_cpu_ms >= _OWN * self.lag_ms:
            return "blocked"
        return "gil" if self.process_cpu_ms >= _BUSY * self.lag_ms else "cpu"

    def culprit(self) -> str:
        """One line: the stall, its cause, where the loop was, the CPU it got."""
        where = " <- ".join(reversed(self.stack[-2:])) if self.stack else "no sample"
        line = (
            f"event loop stalled {self.lag_ms:.0f} ms ({self.cause}): {where}; CPU meanwhile: "
            f"loop thread {self.loop_cpu_ms:.0f} ms, process {self.process_cpu_ms:.0f} ms"
        )
        return line + (f"; other threads busy: {', '.join(self.others[:3])}" if self.others else "")


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
        self.causes: Counter[Cause] = Counter()
        """Every stall of the run, by cause."""
        self._beat = time.perf_counter()
        self._samples: list[tuple[str, ...]] = []
        self._others: list[str] = []

    def note(self, lag_ms: float) -> None:
        """Record one observed lag."""
        self.window_ms = max(self.window_ms, lag_ms)
        self.run_ms = max(self.run_ms, lag_ms)

    def take(self) -> float:
        """The window's largest lag (ms), starting a new window."""
        lag, self.window_ms = self.window_ms, 0.0
        return lag

    def record(
        self,
        lag_ms: float,
        samples: list[tuple[str, ...]],
        *,
        loop_cpu_ms: float = 0.0,
        process_cpu_ms: float = 0.0,
        others: Sequence[str] = (),
    ) -> Stall:
        """A stall of ``lag_ms`` from the loop thread's sampled stacks and CPU times: counted,
        kept if among the worst, logged if the worst so far or ``blocked``."""
        top = Counter(samples).most_common(1)
        stall = Stall(
            lag_ms=lag_ms,
            stack=top[0][0] if top else (),
            stack_samples=top[0][1] if top else 0,
            samples=len(samples),
            loop_cpu_ms=loop_cpu_ms,
            process_cpu_ms=process_cpu_ms,
            expected=max(1, int((lag_ms - self.stall_ms) / (self.sample_s * 1e3))),
            others=tuple(name for name, _ in Counter(others).most_common()),
        )
        worst = not self.stalls or lag_ms > self.stalls[0].lag_ms
        self.causes[stall.cause] += 1
        self.stalls = sorted([*self.stalls, stall], key=lambda s: -s.lag_ms)[: self.keep]
        if (worst or stall.cause == "blocked") and self.log is not None:
            self.log(stall.culprit())
        return stall

    def summary(self) -> str:
        """One line over the run: the stalls by cause and the worst one."""
        if not self.stalls:
            return f"event loop: no stall over {self.stall_ms:.0f} ms"
        causes = ", ".join(f"{n} {cause}" for cause, n in self.causes.most_common())
        return f"event loop: stalls over {self.stall_ms:.0f} ms: {causes}; worst: " + (
            self.stalls[0].culprit()
        )

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
                start, loop_cpu, process_cpu = (
                    time.perf_counter(),
                    time.thread_time(),
                    time.process_time(),
                )
                self._beat = start
                await anyio.sleep(self.tick_s)
                woke = time.perf_counter()
                self._beat = woke
                samples, self._samples = self._samples, []
                others, self._others = self._others, []
                lag_ms = max(0.0, (woke - start - self.tick_s) * 1e3)
                self.note(lag_ms)
                if lag_ms >= self.stall_ms:
                    self.record(
                        lag_ms,
                        samples,
                        loop_cpu_ms=(time.thread_time() - loop_cpu) * 1e3,
                        process_cpu_ms=(time.process_time() - process_cpu) * 1e3,
                        others=others,
                    )
        finally:
            stop.set()
            sampler.join()

    def _sample(self, loop_thread: int, stop: threading.Event) -> None:
        """The sampling thread: the loop thread's stack whenever the loop is late."""
        while not stop.wait(self.sample_s):
            late_ms = (time.perf_counter() - self._beat - self.tick_s) * 1e3
            if late_ms < self.stall_ms:
                continue
            frames = sys._current_frames()
            frame = frames.pop(loop_thread, None)
            if frame is not None:
                self._samples.append(_stack(frame))
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, other in frames.items():
                if ident != threading.get_ident() and other.f_code.co_name not in _WAITS:
                    leaf = _stack(other)[-1]
                    self._others.append(f"{names.get(ident, ident)}: {leaf}")


def _stack(frame: object) -> tuple[str, ...]:
    summary = traceback.extract_stack(frame)  # type: ignore[arg-type]
    return tuple(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in summary)


_WAITS = frozenset(
    {"wait", "select", "poll", "sleep", "acquire", "get", "recv", "recv_into", "accept",
     "_wait_for_tstate_lock", "read", "readinto", "run_forever", "_run_once", "join", "_worker"}
)  # fmt: skip
"""Leaf functions of a thread that waits (on a lock, a queue, a socket, a timer)."""


def _idle(stack: tuple[str, ...]) -> bool:
    """The loop thread waits in its selector (for I/O or a timer)."""
    return stack[-1].rsplit(" ", 1)[-1] in ("select", "poll")


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
