"""A watchdog of the driver's event loop: how late a short sleep wakes up.

The loop's pumps, the control-plane client and TransferQueue's async calls share one event
loop; anything that blocks it (a synchronous clear, a large decode) delays all of them.
`LagWatch.run` sleeps ``tick_s`` again and again and keeps the largest overshoot; the
driver takes the window's maximum after each step (`take`).
"""

from __future__ import annotations

import time

import anyio

__all__ = ["LagWatch"]


class LagWatch:
    """The largest event-loop lag (ms) seen since the last `take`, and over the run."""

    def __init__(self, tick_s: float = 0.01) -> None:
        self.tick_s = tick_s
        self.window_ms = 0.0
        self.run_ms = 0.0

    def note(self, lag_ms: float) -> None:
        """Record one observed lag."""
        self.window_ms = max(self.window_ms, lag_ms)
        self.run_ms = max(self.run_ms, lag_ms)

    def take(self) -> float:
        """The window's largest lag (ms), starting a new window."""
        lag, self.window_ms = self.window_ms, 0.0
        return lag

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            start = time.perf_counter()
            await anyio.sleep(self.tick_s)
            self.note(max(0.0, (time.perf_counter() - start - self.tick_s) * 1e3))
