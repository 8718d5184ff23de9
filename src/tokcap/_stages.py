"""Named, timed stages with a progress display (rich): a spinner or a bar per stage.

On a terminal each stage is a live bar; elsewhere (CI logs, pipes) each stage prints one
``[tokcap] <stage> ...`` line when it starts and one with its duration when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["Stages"]


class Stages:
    """``with stages.stage("start engine", total=None) as advance: ...`` times each stage.

    ``timings_s`` maps each finished stage to its wall-clock seconds, in order.
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.timings_s: dict[str, float] = {}
        # Not a terminal (CI, a pipe): one plain line per stage start and end instead.
        self._plain = not self.console.is_terminal
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("{task.description:<28}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=self._plain,
            transient=False,
        )

    def __enter__(self) -> Stages:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    @contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        """Time one stage; the yielded ``advance(n)`` moves its bar (``total`` steps)."""
        task = self._progress.add_task(name, total=total)
        if self._plain:
            self.console.print(f"[tokcap] {name} ...", highlight=False, markup=False)
        start = time.perf_counter()

        def advance(n: int = 1) -> None:
            self._progress.advance(task, n)

        yield advance
        self.timings_s[name] = time.perf_counter() - start
        self._progress.update(task, total=total or 1, completed=total or 1)
        self._progress.stop_task(task)
        if self._plain:
            self.console.print(
                f"[tokcap] {name}: {self.timings_s[name]:.1f} s", highlight=False, markup=False
            )

    def log(self, message: str) -> None:
        """Print a line above the bars."""
        self._progress.console.print(message)
