"""`StageWriter`: the gate's writes of staged calls into the sink, batched (group commit).

A call's row is written as soon as the engine finished it; its ``Staged`` entry waits for
the sink's answer, and a close waits for that entry. When a step's rollouts all finish at
once, one put per call queues as many round trips to the sink as there are calls, and the
last close waits for the last of them. So up to `WRITERS` puts run at once, and
calls that finish while they are all in flight go together in the next one: one round
trip for all of them. A lone call is written at once, as before, and so are the last
calls of a burst while the put before them is still in flight.

A call whose images are new stages their media blobs first (`_media_refs.MediaRefs`:
named for its rollout, stored once by tensors digest), then its row.

Failure stays with its rollout: a put the sink refuses is retried call by call (an
identical re-put is a no-op), so only the rows the sink refuses fail; a timeout fails the
whole put (the sink, not a row, is at fault). Every call's ``sink_done`` is set exactly
once, with its ``stage_error`` (``gate_not_serving`` if the gate stopped before its put
answered).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

from tokcap_core.sink import TokenSink

from ._media_refs import MediaRefs
from ._records import GateCall

__all__ = ["StageWriter"]

WRITERS = 2
"""Puts in flight at once (each of a batch of queued calls)."""

Written = Callable[[list[GateCall], float], Awaitable[None]]
"""Told, after each put, the calls it wrote (each with its ``stage_error``) and its seconds."""


class StageWriter:
    """Writes queued staged calls to ``sink``, one put per batch, ``timeout_s`` per put."""

    def __init__(self, sink: TokenSink, timeout_s: float, written: Written) -> None:
        self.sink = sink
        self.media = MediaRefs(sink)
        """The media blobs staged and the rollouts naming them."""
        self.timeout_s = timeout_s
        self.written = written
        self._queued: list[GateCall] = []
        self._writing = 0  # tasks of the gate's group draining `_queued`

    def write(self, call: GateCall, tg: TaskGroup) -> None:
        """Queue ``call`` (its ``staged`` row built); a task in ``tg`` writes the queue."""
        self._queued.append(call)
        if self._writing < WRITERS:
            self._writing += 1
            tg.start_soon(self._drain)

    async def _drain(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                await self._stage(batch)
        finally:
            self._writing -= 1
            left, self._queued = self._queued, []
            for call in left:  # cancelled (the gate stopped serving) before their put
                call.stage_error = "gate_not_serving"
                call.sink_done.set()

    async def _stage(self, calls: list[GateCall]) -> None:
        started = time.perf_counter()
        errors: dict[int, str | None] = {id(call): "gate_not_serving" for call in calls}
        try:
            error = await self._put(calls)
            errors = dict.fromkeys(errors, error)
            if error is not None and error != "timeout" and len(calls) > 1:

                async def alone(call: GateCall) -> None:
                    errors[id(call)] = await self._put([call])

                async with anyio.create_task_group() as tg:
                    for call in calls:
                        tg.start_soon(alone, call)
        finally:
            for call in calls:
                call.stage_error = errors[id(call)]
                call.sink_done.set()
        await self.written(calls, time.perf_counter() - started)

    async def _put(self, calls: list[GateCall]) -> str | None:
        """One sink put of the calls' rows; the error code if it failed."""
        try:
            with anyio.fail_after(self.timeout_s):
                await self.media.put(
                    (call.rollout_id, call.result.media_blobs)
                    for call in calls
                    if call.staged is not None
                    and call.result is not None
                    and call.result.media_blobs
                )
                await self.sink.put([call.staged for call in calls if call.staged is not None])
        except TimeoutError:
            return "timeout"
        except Exception as e:  # the sink's failure is recorded for these rollouts alone
            return getattr(e, "code", None) or type(e).__name__
        return None
