"""Staged calls read ahead of the bundle that will need them.

A trainer asks the actor a bundle will go to (`ReassemblerPool.prefetch`) to read its
rollouts' staged calls while it closes them and verifies their receipts; the bundle then
takes what was read (`ReadAhead.take`) instead of reading it again. Nothing read ahead is
trusted: a reassembly uses a staged call only through its verified receipt, which binds
the call's digest, as it does with a call read with the bundle. A call the read-ahead
missed (staged after it listed the partition) is read with the bundle as usual, and a
read-ahead that failed only means the bundle reads everything itself.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio

from tokcap_core import StagedCall, TokenSink
from tokcap_core.ids import StagingKey

__all__ = ["KEPT", "ReadAhead"]

KEPT = 8
"""Read-aheads an actor holds; an older one nobody took is dropped."""

_log = logging.getLogger(__name__)

Fetch = Callable[[list[StagingKey]], Awaitable[tuple[dict[StagingKey, StagedCall], int]]]


@dataclass(slots=True)
class _Ahead:
    rollouts: frozenset[str]
    done: anyio.Event = field(default_factory=anyio.Event)
    calls: dict[StagingKey, StagedCall] = field(default_factory=dict)


def _rollout_of(key: str) -> str:
    return key.partition("/")[0]  # a staging key is ``<rollout id>/<call id>``


class ReadAhead:
    """An actor's read-aheads, the newest `KEPT`."""

    def __init__(self) -> None:
        self._ahead: deque[_Ahead] = deque(maxlen=KEPT)

    def expect(self, rollout_ids: Iterable[str]) -> _Ahead:
        """Hold a place for a read-ahead of ``rollout_ids`` (before anything is awaited, so
        a bundle that comes while it is being read waits for it); fill it with `read`."""
        ahead = _Ahead(frozenset(rollout_ids))
        self._ahead.append(ahead)
        return ahead

    async def read(self, ahead: _Ahead, sink: TokenSink, fetch: Fetch) -> int:
        """Read every staged call ``sink`` holds for ``ahead``'s rollouts (with ``fetch``,
        which gives the present ones of the keys it is asked); how many were read. Never
        raises."""
        try:
            keys = [k for k in await sink.staged_keys() if _rollout_of(k) in ahead.rollouts]
            if keys:
                ahead.calls, _ = await fetch(keys)
        except Exception as e:  # the bundle reads what it lacks; nothing depends on this
            _log.warning("tokcap: reading %d rollouts ahead failed: %s", len(ahead.rollouts), e)
        finally:
            ahead.done.set()
        return len(ahead.calls)

    async def take(self, keys: Sequence[StagingKey]) -> dict[StagingKey, StagedCall]:
        """The calls of ``keys`` read ahead (waiting for a read-ahead still under way); the
        read-aheads that held any of their rollouts are used up."""
        wanted = {_rollout_of(k) for k in keys}
        found: dict[StagingKey, StagedCall] = {}
        for ahead in [a for a in self._ahead if a.rollouts & wanted]:
            await ahead.done.wait()
            if ahead in self._ahead:
                self._ahead.remove(ahead)
            found.update(ahead.calls)
        return {k: found[k] for k in keys if k in found}
