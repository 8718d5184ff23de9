"""`RolloutReassemblerActor`: one group in, exactly N training rows published, one summary out.

Per request: check the progress record (a retry of a finished group returns the
recorded `FinalizedGroup` and writes nothing); fetch every on-chain staged row in one
batched ``get``, less those read ahead (`RolloutReassemblerActor.prefetch`; on
`MissingRows`, fetch the present ones once more: the missing rollouts become
``missing_rows`` placeholders); verify and reassemble with the core;
publish, while recording ``publishing``; once both are done, clear the group's staging
keys; record ``published``. A bundle of groups the pool has never sent
(`RolloutReassemblerActor.reassemble_many`) takes the same steps together: one fetch,
one record call, one publish, one clear, each group still recorded on its own.

Why the record may travel with the publish: until the staged calls are cleared, a redo
reads the same calls and rebuilds the same rows, and a sink keeps a held identical row
(the `TokenSink` contract), so a publish cut short is completed, never doubled. The clear
is what a redo could not undo; it waits for the record.

An attempt that died with no record had not cleared anything: start over. A record left
at ``publishing`` means an attempt died after the record but before the end of its clear.
The training keys then decide, never a guess: all present -> published (finish the
clear); none -> nothing was written, start over; some -> ``outcome="unknown"`` with the
keys to check.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import anyio

from tokcap_core import FinalizedGroup, MissingRows, ReassemblyRequest, StagedCall, TokenSink
from tokcap_core.ids import StagingKey
from tokcap_core.rows import on_chain_keys, reassemble_group
from tokcap_core.rpc import assert_metadata_only

from ._ahead import ReadAhead
from ._await import await_ref
from ._progress import GroupRecord, RecordState

__all__ = ["RolloutReassemblerActor", "SinkFactory"]

SinkFactory: TypeAlias = Callable[[], "TokenSink | Awaitable[TokenSink]"]
"""A picklable zero-arg callable building a sink (or an awaitable of one) in an actor."""

TIMING_KEYS = ("time/fetch_ms", "time/reassemble_ms", "time/publish_ms", "time/clear_ms")
"""Per-group timings (ms) added to the core's metrics; ``reassemble`` is verify+assemble,
one pass in the core. A group recovered after its actor died reports 0.0 for the steps
the dead actor did."""


class _Pending:
    """One group being reassembled; concurrent duplicates wait for it instead of redoing it."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: FinalizedGroup | None = None
        self.error: BaseException | None = None


class RolloutReassemblerActor:
    """Reassembles groups into a sink's training partition (run as an async Ray actor).

    ``sink_factory`` runs here, in the actor process, so a sink opens its own
    connections; it may return the sink or an awaitable of it (``TQSink.connect``).
    ``progress`` is the pool's ``ProgressActor`` handle.
    """

    def __init__(self, sink_factory: SinkFactory, progress: Any) -> None:
        self._made: TokenSink | Awaitable[TokenSink] = sink_factory()
        self._sink_lock = anyio.Lock()
        self._progress = progress
        self._pending: dict[str, _Pending] = {}
        self._ahead = ReadAhead()

    async def ready(self) -> bool:
        """True once the actor and its sink are up."""
        await self._get_sink()
        return True

    async def _get_sink(self) -> TokenSink:
        async with self._sink_lock:
            if inspect.isawaitable(self._made):
                self._made = await self._made
            return self._made

    @property
    def _sink(self) -> TokenSink:
        assert not inspect.isawaitable(self._made), "ready() builds the sink first"
        return self._made

    async def reassemble(
        self, request: ReassemblyRequest, *, first_attempt: bool = False
    ) -> FinalizedGroup:
        """Reassemble and publish ``request``'s group (idempotent by group id).

        ``first_attempt=True`` (the pool has never sent this group before) skips the
        progress lookup: no record can exist yet.
        """

        async def work(requests: list[ReassemblyRequest]) -> list[FinalizedGroup]:
            return [await self._run(requests[0], first_attempt)]

        return (await self._coalesced([request], work))[0]

    async def reassemble_many(self, requests: list[ReassemblyRequest]) -> list[FinalizedGroup]:
        """Reassemble and publish a bundle of groups the pool has never sent (first attempts,
        so no progress lookup), results in request order: one fetch of all their staged
        rows, one publish of all their rows. A group already being worked on here is waited
        for, as `reassemble` waits for a duplicate; a group listed twice is done once.
        """

        async def work(fresh: list[ReassemblyRequest]) -> list[FinalizedGroup]:
            await self._get_sink()
            return await self._fresh_many(fresh)

        return await self._coalesced(requests, work)

    async def prefetch(self, rollout_ids: list[str]) -> int:
        """Read the staged calls the sink holds for ``rollout_ids`` now, ahead of the bundle
        that will need them (`ReassemblerPool.prefetch`); how many were read. Never raises:
        a bundle reads whatever was not read ahead."""
        ahead = self._ahead.expect(rollout_ids)
        return await self._ahead.read(ahead, await self._get_sink(), self._fetch)

    async def _coalesced(
        self,
        requests: list[ReassemblyRequest],
        work: Callable[[list[ReassemblyRequest]], Awaitable[list[FinalizedGroup]]],
    ) -> list[FinalizedGroup]:
        """``work`` on the groups nobody is working on here yet; the others are waited for."""
        for request in requests:
            assert_metadata_only(request)
        waits = {
            r.group_id: self._pending[r.group_id] for r in requests if r.group_id in self._pending
        }
        mine = list({r.group_id: r for r in requests if r.group_id not in waits}.values())
        owned = {r.group_id: _Pending() for r in mine}
        if mine:
            self._pending.update(owned)
            # Shielded: once started, a group runs to the end even if its caller is
            # cancelled, so no cancellation can leave a half-written group behind.
            with anyio.CancelScope(shield=True):
                try:
                    for request, result in zip(mine, await work(mine), strict=True):
                        owned[request.group_id].result = result
                except BaseException as e:
                    for pending in owned.values():
                        pending.error = e
                    raise
                finally:
                    for group_id, pending in owned.items():
                        del self._pending[group_id]
                        pending.done.set()
        out = []
        for request in requests:
            pending = owned.get(request.group_id) or waits[request.group_id]
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            assert pending.result is not None
            assert_metadata_only(pending.result)
            out.append(pending.result)
        return out

    async def _run(self, request: ReassemblyRequest, first_attempt: bool) -> FinalizedGroup:
        await self._get_sink()
        record: GroupRecord | None = None
        if not first_attempt:
            record = await await_ref(self._progress.get.remote(request.group_id))
        if record is None:
            return await self._fresh(request)
        if record.state == "publishing":
            return await self._resume(request, record.finalized)
        return record.finalized

    async def _fresh(self, request: ReassemblyRequest) -> FinalizedGroup:
        return (await self._fresh_many([request]))[0]

    async def _fresh_many(self, requests: list[ReassemblyRequest]) -> list[FinalizedGroup]:
        """Groups nobody has started: one fetch of all their staged rows, one ``publishing``
        record call, one publish, one clear, then the ``published`` records."""
        t0 = time.perf_counter()
        keys = [k for r in requests for k in on_chain_keys(r)]
        ahead = await self._ahead.take(keys)
        rest = [k for k in keys if k not in ahead]
        staged = ahead | (await self._fetch(rest))[0] if rest else ahead
        t1 = time.perf_counter()
        fetch = {"time/fetch_ms": (t1 - t0) * 1e3}
        results = []
        for request in requests:
            start = time.perf_counter()
            mine = on_chain_keys(request)
            counts = {
                "staging/missing_keys": float(sum(k not in staged for k in mine)),
                "staging/read_ahead_keys": float(sum(k in ahead for k in mine)),
            }
            result = reassemble_group(
                request,
                staged,
                staging_cleared=request.clear_staging,
                extra_metrics=dict.fromkeys(TIMING_KEYS, 0.0) | fetch | counts,
            )
            spent = {"time/reassemble_ms": (time.perf_counter() - start) * 1e3}
            results.append((result, _with_metrics(result.finalized, spent)))
        # The ``publishing`` records travel while the rows are published: what they guard
        # is the clear of the staged calls (the one step a redo could not undo), so they
        # must land before it, not before the publish (see the module docstring).
        publishing = self._progress.put_many.remote(
            {f.group_id: GroupRecord(state="publishing", finalized=f) for _, f in results}
        )
        t2 = time.perf_counter()
        await self._sink.publish(
            {k: row for result, _ in results for k, row in result.rows.items()}
        )
        t3 = time.perf_counter()
        await await_ref(publishing)
        clears = [k for r in requests if r.clear_staging for k in r.staging_keys]
        if clears:
            await self._sink.clear(clears)
        t4 = time.perf_counter()
        spent = {"time/publish_ms": (t3 - t2) * 1e3, "time/clear_ms": (t4 - t3) * 1e3}
        finalized = [_with_metrics(f, spent) for _, f in results]
        # Not awaited: Ray runs this caller's calls to the progress actor in order, and
        # if these records are lost the "publishing" ones still resolve to published.
        self._progress.put_many.remote(
            {f.group_id: GroupRecord(state="published", finalized=f) for f in finalized}
        )
        return finalized

    async def _resume(self, request: ReassemblyRequest, recorded: FinalizedGroup) -> FinalizedGroup:
        keys = recorded.training_keys
        try:
            await self._sink.fetch(keys)
            present = len(keys)
        except MissingRows as e:
            present = len(keys) - len(set(e.missing))
        if present == 0:
            return await self._fresh(request)
        if present < len(keys):
            unknown = dataclasses.replace(recorded, outcome="unknown", staging_cleared=False)
            await self._record(request.group_id, "unknown", unknown)
            return unknown
        if request.clear_staging:
            await self._sink.clear(request.staging_keys)
        await self._record(request.group_id, "published", recorded)
        return recorded

    async def _fetch(self, keys: list[StagingKey]) -> tuple[dict[StagingKey, StagedCall], int]:
        """All staged rows of ``keys`` in one batch, or the present ones and the missing count."""
        try:
            calls = await self._sink.get(keys)
            missing = 0
        except MissingRows as e:
            absent = set(e.missing)
            present = [k for k in keys if k not in absent]
            calls = await self._sink.get(present) if present else []
            missing = len(keys) - len(present)
        return {call.key: call for call in calls}, missing

    async def _record(self, group_id: str, state: RecordState, finalized: FinalizedGroup) -> None:
        record = GroupRecord(state=state, finalized=finalized)
        await await_ref(self._progress.put.remote(group_id, record))


def _with_metrics(finalized: FinalizedGroup, extra: dict[str, float]) -> FinalizedGroup:
    return dataclasses.replace(finalized, metrics=finalized.metrics | extra)
