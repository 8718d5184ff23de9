"""The reference sink across processes: a `MemorySink` inside a Ray actor, and its proxy.

``ActorSink`` implements `tokcap_core.TokenSink` by forwarding every call to one
``SinkActor``; it is picklable (it holds only the actor handle), so a pool's
``sink_factory`` can be ``sink.factory()`` and every reassembler actor talks to the
same store. For users without TransferQueue, and for tests: rows cross a process
boundary per call, so it is slower than a real distributed store's direct reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayTaskError

from tokcap_core import MemorySink, StagedCall, TrainingRow
from tokcap_core.ids import StagingKey, TrainingKey

from ._await import await_ref

__all__ = ["ActorSink", "SinkActor"]


class SinkActor(MemorySink):
    """A `MemorySink` as a Ray actor (start it with `ActorSink.start`)."""


class ActorSink:
    """A `TokenSink` that forwards to a ``SinkActor``; errors arrive as the sink raised them."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @classmethod
    def start(cls, **actor_options: Any) -> ActorSink:
        """Start a ``SinkActor`` (``num_cpus=0`` unless given) and return its proxy."""
        actor_options.setdefault("num_cpus", 0)
        return cls(ray.remote(SinkActor).options(**actor_options).remote())

    def factory(self) -> Callable[[], ActorSink]:
        """A picklable zero-arg callable making a proxy to the same actor (a ``sink_factory``)."""
        return functools.partial(type(self), self.handle)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await await_ref(getattr(self.handle, method).remote(*args))
        except RayTaskError as e:
            raise e.cause from None  # the sink's own typed error, e.g. MissingRows

    async def put(self, calls: Sequence[StagedCall]) -> None:
        """Store staged calls (see `TokenSink.put`)."""
        await self._call("put", list(calls))

    async def get(self, keys: Sequence[StagingKey]) -> list[StagedCall]:
        """The staged calls for ``keys``, or `MissingRows`."""
        result: list[StagedCall] = await self._call("get", list(keys))
        return result

    async def clear(self, keys: Sequence[StagingKey]) -> None:
        """Free staged calls; absent keys are ignored."""
        await self._call("clear", list(keys))

    async def publish(self, rows: Mapping[TrainingKey, TrainingRow]) -> None:
        """Store training rows under their keys."""
        await self._call("publish", dict(rows))

    async def fetch(self, keys: Sequence[TrainingKey]) -> list[TrainingRow]:
        """The training rows for ``keys``, or `MissingRows`."""
        result: list[TrainingRow] = await self._call("fetch", list(keys))
        return result

    async def clear_rows(self, keys: Sequence[TrainingKey]) -> None:
        """Free training rows; absent keys are ignored."""
        await self._call("clear_rows", list(keys))

    async def staged_keys(self) -> list[StagingKey]:
        """Every staging key the actor holds (leak checks)."""
        result: list[StagingKey] = await self._call("staged_keys")
        return result

    async def row_keys(self) -> list[TrainingKey]:
        """Every training key the actor holds (leak checks)."""
        result: list[TrainingKey] = await self._call("row_keys")
        return result
