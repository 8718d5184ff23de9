"""Errors of the Ray adapter: one class, split by stable codes, picklable across Ray."""

from __future__ import annotations

from tokcap_core import TokcapError

__all__ = ["PoolError"]


class PoolError(TokcapError, RuntimeError):
    """The reassembler pool could not do what was asked.

    Codes: ``ray_not_initialized`` (call ``ray.init`` first), ``pool_closed``,
    ``retries_exhausted`` (every attempt lost its actor *before* publishing started, so
    nothing was published and the request may be submitted again).
    """
