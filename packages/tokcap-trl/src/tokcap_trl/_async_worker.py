"""TRL's rollout-worker interface for ``AsyncGRPOTrainer``, playing groups through gates.

``AsyncGRPOTrainer`` drains ``rollout_buffer`` (``RolloutSample``s) and ``metrics_queue``
on its own thread, calls ``start()`` after the first weight sync, ``update_model_version``
after every sync, ``check_health(stale_after_s)`` whenever the buffer stayed empty for a
poll interval (it waits forever unless that raises), and ``stop()`` at the end.

`GateRolloutWorker` plays groups on the adapter's event loop (an anyio blocking portal),
``max_groups_in_flight`` at a time, cycling over ``prompts``: each group is
``group_size`` rollouts of one prompt, collected by the shared `Collector` (open on the
gates, play the harness, close, verify every receipt, rebuild rows from the sink, clear,
release; a poisoned rollout comes back as a placeholder row with its reason). The rows
become samples (`group_samples`); poisoned rollouts never enter the buffer and are
counted in the metrics (``tokcap/left_out/<bucket>_total``). A full buffer holds the
player back (TRL's back-pressure), it drops nothing.

Health, by rule: a player that raised fails the worker (``check_health`` raises
`TRLAdapterError` ``rollouts_failed`` from it, on the next call); a worker that was never
started or was stopped raises ``rollouts_stopped``; no group finished within
``stale_after_s`` (counted from ``start`` or the last group) raises ``rollouts_stalled``.
``update_model_version`` raises ``weight_version_mismatch`` unless TRL's version is the one
`PolicyVersions` counted for the last push: the worker's samples and TRL's staleness
check must use one numbering.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ._async_samples import group_samples
from ._async_transfer import PolicyVersions
from ._collect import Collector, RolloutPlan
from ._errors import TRLAdapterError
from ._harness import Harness, Prompt, prompt_messages

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

__all__ = ["GateRolloutWorker"]


class GateRolloutWorker:
    """``rollout_worker=`` for ``AsyncGRPOTrainer``: verified samples from gates (see the
    module). ``portal`` runs the players; ``versions`` is shared with the weight transfer;
    rollout ids are ``{run_id}-g{group}-{i}`` (unique among the gates' live rollouts).
    """

    def __init__(
        self,
        collector: Collector,
        harness: Harness,
        prompts: Sequence[Prompt],
        *,
        group_size: int,
        run_id: str,
        portal: BlockingPortal,
        versions: PolicyVersions,
        max_groups_in_flight: int = 2,
        buffer_size: int = 0,
        rollout_buffer: queue.Queue[Any] | None = None,
    ) -> None:
        if not prompts:
            raise TRLAdapterError("no_prompts", "the rollout worker needs at least one prompt")
        if group_size < 2:
            raise TRLAdapterError("bad_config", "GRPO needs at least 2 rollouts per group")
        if max_groups_in_flight < 1:
            raise TRLAdapterError("bad_config", "max_groups_in_flight must be at least 1")
        self.rollout_buffer: queue.Queue[Any] = rollout_buffer or queue.Queue(buffer_size)
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue(maxsize=4096)
        self._collector = collector
        self._harness = harness
        self._group_size = group_size
        self._run_id = run_id
        self._prompts = list(prompts)
        self._portal = portal
        self._versions = versions
        self._in_flight = max_groups_in_flight
        self._future: concurrent.futures.Future[None] | None = None
        self._stopping = False  # read and set on the loop only
        self._scope: anyio.CancelScope | None = None
        self._finished = threading.Event()
        self._progress_at = 0.0
        self._lock = threading.Lock()
        self.groups = 0
        """Groups played so far."""
        self.left_out: dict[str, int] = {}
        """Rows that did not become samples, by reason bucket (poisoned rollouts)."""
        self.counts: dict[str, int] = {}
        """``tokcap/rollouts`` and ``tokcap/receipts_verified`` so far."""

    @property
    def running(self) -> bool:
        """Whether the players were started and have not finished (failed or stopped)."""
        return self._future is not None and not self._future.done()

    def start(self) -> None:
        """Start playing groups in the background (once; after the first weight sync)."""
        if self._future is not None:
            raise TRLAdapterError("already_started", "the rollout worker was started already")
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        self._progress_at = time.monotonic()
        self._future = self._portal.start_task_soon(self._run, RolloutSample)

    def stop(self) -> None:
        """Stop the players and wait for them (what they held is cleaned up by them)."""
        if self._future is None or self._future.done():
            return
        # On the loop, so it is ordered with the players' start: they see it either way.
        self._portal.call(self._cancel)
        if not self._finished.wait(timeout=120):
            raise TRLAdapterError("stop_timeout", "the rollout players did not stop in 120 s")

    def update_model_version(self, model_version: int) -> None:
        """Check TRL's version is the one the weight transfer counted."""
        if model_version != self._versions.current:
            raise TRLAdapterError(
                "weight_version_mismatch",
                f"TRL is at version {model_version}, the gates were pushed "
                f"{self._versions.current} times: one numbering is needed for staleness",
            )

    def check_health(self, stale_after_s: float) -> None:
        """Raise `TRLAdapterError` if the players failed, stopped or stalled."""
        future = self._future
        if future is None:
            raise TRLAdapterError("rollouts_stopped", "the rollout worker was never started")
        if future.done():
            error = None if future.cancelled() else future.exception()
            if error is not None:
                raise TRLAdapterError(
                    "rollouts_failed", f"a rollout group failed: {error!r}"
                ) from error
            raise TRLAdapterError("rollouts_stopped", "the rollout worker stopped")
        with self._lock:
            idle = time.monotonic() - self._progress_at
        if idle > stale_after_s:
            raise TRLAdapterError(
                "rollouts_stalled",
                f"no rollout group finished in {idle:.0f} s (stale after {stale_after_s:.0f} s)",
            )

    def _cancel(self) -> None:
        self._stopping = True
        if self._scope is not None:
            self._scope.cancel()  # the players' shielded clean-up still runs

    async def _run(self, sample_type: Any) -> None:
        ids = itertools.count()
        try:
            with anyio.CancelScope() as self._scope:
                async with anyio.create_task_group() as tg:
                    for _ in range(self._in_flight):
                        tg.start_soon(self._player, ids, sample_type)
        finally:
            self._finished.set()

    async def _player(self, ids: itertools.count[int], sample_type: Any) -> None:
        while not self._stopping:
            group_id = next(ids)
            prompt = self._prompts[group_id % len(self._prompts)]
            plans = [
                RolloutPlan(
                    rollout_id=f"{self._run_id}-g{group_id}-{i}",
                    group_id=str(group_id),
                    prompt=prompt,
                )
                for i in range(self._group_size)
            ]
            batch = await self._collector.collect(plans, self._harness)
            rows = [c.row for c in batch.rollouts]
            made = group_samples(
                rows,
                group_id=group_id,
                base_version=self._versions.base,
                prompt=prompt_messages(prompt),
                sample_type=sample_type,
            )
            for sample in made.samples:
                await self._put(sample)
            self._record(made.left_out, batch.metrics, len(made.samples), made.rewards)

    async def _put(self, sample: Any) -> None:
        while True:
            sample.enqueued_at = time.time()
            try:
                self.rollout_buffer.put_nowait(sample)
                return
            except queue.Full:
                await anyio.sleep(0.05)

    def _record(
        self,
        left_out: Mapping[str, int],
        collected: Mapping[str, float],
        samples: int,
        rewards: Sequence[float],
    ) -> None:
        with self._lock:
            self._progress_at = time.monotonic()
            self.groups += 1
            for bucket, n in left_out.items():
                self.left_out[bucket] = self.left_out.get(bucket, 0) + n
            for key in ("tokcap/rollouts", "tokcap/receipts_verified"):
                self.counts[key] = self.counts.get(key, 0) + int(collected.get(key, 0))
        metrics: dict[str, float] = {
            "tokcap/groups_total": 1.0,
            "tokcap/rollouts_total": collected.get("tokcap/rollouts", 0.0),
            "tokcap/receipts_verified_total": collected.get("tokcap/receipts_verified", 0.0),
            "tokcap/samples_total": float(samples),
            "tokcap/left_out_total": float(sum(left_out.values())),
            **{f"tokcap/left_out/{b}_total": float(n) for b, n in left_out.items()},
        }
        if rewards:
            metrics["tokcap/group_reward_mean"] = sum(rewards) / len(rewards)
        with contextlib.suppress(queue.Full):  # metrics never hold rollouts back
            self.metrics_queue.put_nowait(metrics)
