"""`ReassemblerPool`: the controller's async door to a set of reassembler actors.

Routing is by a stable hash of the group id (BLAKE2b, the same in every process), so
a retry meets the actor that may still be working on it and coalesces with it; a bundle
of new groups (`ReassemblerPool.as_completed`) goes to its first group's actor, and a
duplicate of one of its groups waits in the pool until the bundle is done. An
actor that dies (``RayActorError``) is killed for good, replaced in its slot, and
the request retried on the replacement, which reads the group's progress record
(see ``RolloutReassemblerActor``) and so never publishes twice. On a multi-node
cluster the actors are spread over the nodes (``scheduling_strategy="SPREAD"``) and the
progress records stay on the pool's own node, so a lost node loses only actors: their
groups are redone by replacements on the nodes left. Retries exhausted:
the record decides -- none means nothing was published (`PoolError`
``retries_exhausted``, safe to submit again); ``publishing`` gives
``outcome="unknown"`` with the keys to check.

The pool reports; it never decides. The controller applies the core's policy::

    async with ReassemblerPool(2, sink.factory()) as pool:
        async with pool.as_completed(requests) as results:
            async for finalized in results:
                match decide_group(finalized, min_valid_fraction=0.5):
                    case Accept():
                        ready.append(finalized)
                    case Replace() | Drop() as decision:
                        await sink.clear_rows(finalized.training_keys)
                        ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import ray
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokcap_core import FinalizedGroup, ReassemblyRequest
from tokcap_core.rpc import assert_metadata_only

from ._actor import RolloutReassemblerActor, SinkFactory
from ._await import await_ref
from ._config import PoolConfig
from ._errors import PoolError
from ._progress import GroupRecord, ProgressActor

__all__ = ["ReassemblerPool"]

BUNDLE_GROUPS = 16
"""At most this many groups in one actor call of `ReassemblerPool.as_completed` (a bundle
shares one fetch of staged rows and one publish of training rows)."""
BUNDLE_MIN_GROUPS = 4
"""New groups are spread over more actors only in bundles of at least this many: a
bundle's round trips to the sink cost about the same for one group as for sixteen, so
below it a second actor costs more than it saves (`bench/bench_train.py`, 2 cores: four
groups in one bundle 28-29 ms, in two of two 31-33 ms)."""


@dataclass(slots=True)
class _Slot:
    handle: Any
    generation: int


class ReassemblerPool:
    """``num_workers`` Ray actors reassembling `ReassemblyRequest`s into a sink.

    ``sink_factory`` is a picklable zero-arg callable, run inside each actor to build
    its `TokenSink` or an awaitable of one (``functools.partial(TQSink.connect, cfg)``
    connects there; `ActorSink.factory()` for the reference sink). Ray must already
    be initialised. Use as ``async with`` (waits until every actor is up; kills them
    on exit), or call `start` / `close`.
    """

    def __init__(
        self,
        num_workers: int,
        sink_factory: SinkFactory,
        *,
        num_cpus: float = 1.0,
        max_in_flight: int = 64,
        actor_concurrency: int = 8,
        max_retries: int = 2,
        scheduling_strategy: Any = "SPREAD",
    ) -> None:
        self.config = PoolConfig(
            num_workers=num_workers,
            num_cpus=num_cpus,
            max_in_flight=max_in_flight,
            actor_concurrency=actor_concurrency,
            max_retries=max_retries,
            scheduling_strategy=scheduling_strategy,
        )
        if not ray.is_initialized():
            raise PoolError("ray_not_initialized", "call ray.init() before creating the pool")
        self._sink_factory = sink_factory
        self._actor_class = ray.remote(RolloutReassemblerActor)
        # The records must outlive any reassembler's node: they live on this process's node
        # (if that node dies, so does the pool that reads them).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._progress: Any = (
            ray.remote(ProgressActor).options(num_cpus=0, scheduling_strategy=here).remote()
        )
        self._slots = [_Slot(self._spawn(), 0) for _ in range(num_workers)]
        self._in_flight = anyio.Semaphore(max_in_flight)
        self._closed = False
        self._sent: set[str] = set()  # group ids this pool has sent (no record can predate)
        self._bundled: dict[str, anyio.Event] = {}  # sent in a bundle still in flight
        self.stats: dict[str, float] = dict.fromkeys(
            ("submitted", "finished", "unknown", "actor_deaths", "retries", "bundled"), 0.0
        )
        """Pool counters since creation (plain floats, for any logger); ``bundled``: groups
        sent in bundles (`as_completed`)."""

    @classmethod
    def from_config(cls, config: PoolConfig, sink_factory: SinkFactory) -> ReassemblerPool:
        """A pool with the settings of ``config``."""
        return cls(
            config.num_workers,
            sink_factory,
            num_cpus=config.num_cpus,
            max_in_flight=config.max_in_flight,
            actor_concurrency=config.actor_concurrency,
            max_retries=config.max_retries,
            scheduling_strategy=config.scheduling_strategy,
        )

    def _spawn(self) -> Any:
        options = {
            "num_cpus": self.config.num_cpus,
            "max_concurrency": self.config.actor_concurrency,
            "scheduling_strategy": self.config.scheduling_strategy,
            "max_restarts": 0,  # the pool replaces dead actors itself, so it knows when
        }
        return self._actor_class.options(**options).remote(self._sink_factory, self._progress)

    async def start(self) -> None:
        """Wait until every actor is constructed (its sink built)."""
        self._check_open()
        for slot in list(self._slots):
            await await_ref(slot.handle.ready.remote())

    def close(self) -> None:
        """Kill the actors; a finished group's rows stay in the sink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            ray.kill(slot.handle, no_restart=True)
        ray.kill(self._progress, no_restart=True)

    async def __aenter__(self) -> ReassemblerPool:
        try:
            await self.start()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("pool_closed", "the pool was closed")

    def slot_of(self, group_id: str) -> int:
        """The actor slot a group id is routed to (stable across processes)."""
        # Not crc32: it is affine over GF(2), so ids that differ only in their last digits
        # ("…-g00" … "…-g03", a step's groups) all had the same low bit: on two actors,
        # every group of a step went to one of them.
        digest = hashlib.blake2b(group_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.config.num_workers

    def actor_for(self, group_id: str) -> Any:
        """The actor handle currently serving ``group_id``'s slot."""
        return self._slots[self.slot_of(group_id)].handle

    async def record(self, group_id: str) -> GroupRecord | None:
        """The group's progress record (None if no attempt reached publishing)."""
        record: GroupRecord | None = await await_ref(self._progress.get.remote(group_id))
        return record

    async def forget(self, group_ids: Iterable[str]) -> int:
        """Drop progress records (after the controller removed the groups); how many were held.

        A forgotten group submitted again is reassembled afresh.
        """
        group_ids = list(group_ids)
        self._sent.difference_update(group_ids)
        count: int = await await_ref(self._progress.forget.remote(group_ids))
        return count

    async def submit(self, request: ReassemblyRequest) -> FinalizedGroup:
        """Reassemble one group; waits for a free place under ``max_in_flight``."""
        async with self._in_flight:
            return await self._run(request)

    async def map(self, requests: Iterable[ReassemblyRequest]) -> list[FinalizedGroup]:
        """Reassemble many groups concurrently; results in request order."""
        requests = list(requests)
        positions: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            positions.setdefault(request.group_id, []).append(i)
        out: list[FinalizedGroup | None] = [None] * len(requests)
        async with self.as_completed(requests) as results:
            async for finalized in results:
                out[positions[finalized.group_id].pop()] = finalized
        return [f for f in out if f is not None]

    @asynccontextmanager
    async def as_completed(
        self, requests: Iterable[ReassemblyRequest]
    ) -> AsyncIterator[MemoryObjectReceiveStream[FinalizedGroup]]:
        """A stream of `FinalizedGroup`s in completion order, ``max_in_flight`` at a time.

        ``async with pool.as_completed(reqs) as results: async for f in results: ...``;
        leaving the block early cancels the waits (started groups still finish in their
        actors, and a resubmit returns their result). A failed request raises here.

        Groups this pool has never sent go in bundles, one actor call each: as many as
        there are actors, but none under `BUNDLE_MIN_GROUPS` groups and none over
        `BUNDLE_GROUPS`, each to its own actor while there are actors left. Each bundle is
        one fetch of staged rows and one publish of training rows in its actor. A bundle
        whose actor dies is retried group by group; retries and duplicates always go alone
        (a duplicate of a group in a bundle still in flight waits for the bundle, then the
        group's record decides). A bundle's groups are delivered together: once its first
        group is received, the others are already in the stream
        (``results.receive_nowait()`` gets them without waiting), so a caller can read all
        of their rows at once.
        """
        # Unbounded: a bundle's groups go in at once (at most the requests given).
        send, receive = anyio.create_memory_object_stream[FinalizedGroup](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._feed, list(requests), send, tg)
            async with receive:
                yield receive
                tg.cancel_scope.cancel()

    async def _feed(
        self,
        requests: list[ReassemblyRequest],
        send: MemoryObjectSendStream[FinalizedGroup],
        tg: anyio.abc.TaskGroup,
    ) -> None:
        async def run(
            part: list[ReassemblyRequest],
            slot: int | None,
            out: MemoryObjectSendStream[FinalizedGroup],
        ) -> None:
            async with out:
                try:
                    if slot is None:
                        done = [await self._run(part[0])]
                    else:
                        done = await self._run_fresh(part, slot)
                finally:
                    self._in_flight.release()
                    if slot is not None:
                        for request in part:
                            self._bundled.pop(request.group_id).set()
                for finalized in done:
                    out.send_nowait(finalized)  # never blocks (unbounded), so none waits

        async with send:
            for part, slot in self._bundles(requests):
                await self._in_flight.acquire()
                tg.start_soon(run, part, slot, send.clone())

    def _bundles(
        self, requests: list[ReassemblyRequest]
    ) -> list[tuple[list[ReassemblyRequest], int | None]]:
        """``requests`` as actor calls, each with its slot if it holds groups never sent
        before (marked sent and in flight here, so a duplicate in the same call is neither
        taken for a first attempt nor run beside its bundle): those split evenly into
        bundles (see `as_completed`) on consecutive slots from the first group's; every
        other one alone (None: its own group's slot)."""
        alone: list[tuple[list[ReassemblyRequest], int | None]] = []
        fresh: list[ReassemblyRequest] = []
        for request in requests:
            if request.group_id in self._sent:
                alone.append(([request], None))  # a retry or a duplicate: its record decides
                continue
            self._sent.add(request.group_id)
            self._bundled[request.group_id] = anyio.Event()
            fresh.append(request)
        plan = self._plan([request.group_id for request in fresh])
        return [*((fresh[start:end], slot) for slot, start, end in plan), *alone]

    def _plan(self, group_ids: list[str]) -> list[tuple[int, int, int]]:
        """How new groups (in order) are bundled: each bundle's slot and its part
        ``[start:end]`` of ``group_ids`` (see `as_completed`)."""
        if not group_ids:
            return []
        workers, n = self.config.num_workers, len(group_ids)
        count = max(-(-n // BUNDLE_GROUPS), min(workers, n // BUNDLE_MIN_GROUPS))
        first = self.slot_of(group_ids[0])
        cuts = [n * i // count for i in range(count + 1)]
        return [((first + i) % workers, cuts[i], cuts[i + 1]) for i in range(count)]

    def prefetch(self, groups: Mapping[str, Sequence[str]]) -> list[Any]:
        """Have the actors that `as_completed` will send these new groups to read their
        staged calls now: ``groups`` maps each group id to its rollout ids, in the order the
        requests will come. Call it as the rollouts are being closed (before their receipts
        exist): each bundle then finds its calls read (`FinalizedGroup.metrics`
        ``staging/read_ahead_keys``) and reads only those staged after. Groups sent before
        are left out. Returns each actor's answer (an ``ObjectRef`` of how many calls it
        read): nothing needs to await them, as a bundle that arrives while its calls are
        being read waits for them, and one that arrives first reads them itself (Ray does
        not order an async actor's calls). A read-ahead that fails costs only the time."""
        self._check_open()
        new = [group_id for group_id in groups if group_id not in self._sent]
        answers = []
        for slot, start, end in self._plan(new):
            rollout_ids = [r for group_id in new[start:end] for r in groups[group_id]]
            answers.append(self._slots[slot].handle.prefetch.remote(rollout_ids))
        return answers

    async def _run_fresh(
        self, requests: list[ReassemblyRequest], index: int
    ) -> list[FinalizedGroup]:
        """Groups never sent before, to slot ``index``: one alone is a first attempt (no
        record lookup; its slot is its own); several go in one bundle, one actor call; if
        its actor dies, each group is retried alone on its own slot's actor, where its
        progress record decides."""
        self._check_open()
        self.stats["submitted"] += len(requests)
        if len(requests) == 1:
            return [await self._attempts(requests[0], first=0, first_attempt=True)]
        self.stats["bundled"] += len(requests)
        slot = self._slots[index]
        try:
            done: list[FinalizedGroup] = await await_ref(
                slot.handle.reassemble_many.remote(requests)
            )
        except RayTaskError:
            raise  # the actor raised (bad data, sink error): not a death, no retry
        except RayActorError:
            self._replace(index, slot)
        else:
            return [self._finish(finalized) for finalized in done]
        out: list[FinalizedGroup | None] = [None] * len(requests)

        async def retry(i: int) -> None:
            out[i] = await self._attempts(requests[i], first=1, first_attempt=False)

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(retry, i)
        return [f for f in out if f is not None]

    async def _run(self, request: ReassemblyRequest) -> FinalizedGroup:
        self._check_open()
        bundle = self._bundled.get(request.group_id)
        if bundle is not None:  # in a bundle still in flight, maybe on another actor
            await bundle.wait()  # then its record decides
        # The request checked itself when built, and the actor checks it on the way in:
        # a third walk here would cost as much as the reassembly (~2.6 ms for 8 rollouts).
        self.stats["submitted"] += 1
        first_attempt = request.group_id not in self._sent
        self._sent.add(request.group_id)
        return await self._attempts(request, first=0, first_attempt=first_attempt)

    async def _attempts(
        self, request: ReassemblyRequest, *, first: int, first_attempt: bool
    ) -> FinalizedGroup:
        """Send ``request`` to its slot's actor, replacing dead actors, from attempt
        ``first`` (an attempt made in a bundle counts) up to ``max_retries``."""
        index = self.slot_of(request.group_id)
        for attempt in range(first, self.config.max_retries + 1):
            slot = self._slots[index]
            if attempt:
                self.stats["retries"] += 1
            try:
                ref = slot.handle.reassemble.remote(
                    request, first_attempt=first_attempt and not attempt
                )
                finalized: FinalizedGroup = await await_ref(ref)
            except RayTaskError:
                raise  # the actor raised (bad data, sink error): not a death, no retry
            except RayActorError:
                self._replace(index, slot)
                continue
            return self._finish(finalized)
        record = await self.record(request.group_id)
        if record is None:
            raise PoolError(
                "retries_exhausted",
                f"group {request.group_id}: {self.config.max_retries + 1} actors died before "
                "publishing; nothing was published",
            )
        if record.state == "published":
            return self._finish(record.finalized)
        unknown = dataclasses.replace(record.finalized, outcome="unknown", staging_cleared=False)
        return self._finish(unknown)

    def _finish(self, finalized: FinalizedGroup) -> FinalizedGroup:
        assert_metadata_only(finalized)
        self.stats["finished"] += 1
        self.stats["unknown"] += finalized.outcome == "unknown"
        return finalized

    def _replace(self, index: int, dead: _Slot) -> None:
        """Replace a dead actor once, however many requests saw it die."""
        if self._slots[index] is not dead or self._closed:
            return
        self.stats["actor_deaths"] += 1
        ray.kill(dead.handle, no_restart=True)  # an unreachable actor must not publish later
        self._slots[index] = _Slot(self._spawn(), dead.generation + 1)
