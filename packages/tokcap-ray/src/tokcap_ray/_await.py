"""Awaiting Ray results without blocking the caller's event loop.

On asyncio (anyio's default backend, and Ray's own actor loops) an ``ObjectRef`` is
awaited natively: no thread per request, so hundreds can be in flight, and a
cancelled waiter stops waiting at once. On any other anyio backend (trio) the
blocking ``ray.get`` runs in a worker thread, abandoned if the waiter is cancelled.
Either way, cancelling a waiter never cancels the Ray task itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio.to_thread
import ray

__all__ = ["await_ref"]


def _on_asyncio() -> bool:
    """Whether an asyncio loop runs this task (what awaiting an ``ObjectRef`` needs)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def await_ref(ref: Any) -> Any:
    """The value of ``ref`` (an ``ObjectRef``); Ray's errors propagate unchanged."""
    if _on_asyncio():
        return await ref
    return await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
