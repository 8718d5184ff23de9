"""`PortalScope`: the synchronous ``with`` that both TRL adapters are.

TRL calls its adapters from its own thread, synchronously; what they hold (a
`tokcap_vllm.GateFleet`, its weight sync, the collector) is asynchronous. A scope starts
an anyio blocking portal (an event loop in a thread of its own) and opens everything on
one exit stack: a failure halfway through ``__enter__`` closes what was already open, and
``__exit__`` closes all of it, last opened first, the portal last.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Self

from anyio.from_thread import BlockingPortal, start_blocking_portal

__all__ = ["PortalScope"]


class PortalScope:
    """A context manager over a blocking portal; a subclass says what it opens (`_open`)
    and what it drops on exit (`_forget`)."""

    _stack: contextlib.ExitStack | None = None
    _portal: BlockingPortal | None = None
    """The portal (inside the ``with``)."""

    def _open(self, stack: contextlib.ExitStack, portal: BlockingPortal) -> None:
        """Open what the scope holds on ``portal``, each on ``stack``, and keep it."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop what `_open` kept (the stack closes it)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal())
            try:
                self._open(stack, portal)
            except BaseException:
                self._forget()  # the stack closes what was opened
                raise
            self._portal = portal
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        self._forget()
        self._portal = None
        if stack is not None:
            stack.close()
