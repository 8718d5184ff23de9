"""`AsyncGRPOGates`: what TRL's ``AsyncGRPOTrainer`` needs from tokcap, in one ``with``.

::

    with AsyncGRPOGates(urls, token, sink, harness, prompts, model=..., group_size=4,
                        max_seq_len=1024) as gates:
        trainer = AsyncGRPOTrainer(model_dir, args=..., train_dataset=...,
                                   rollout_worker=gates.rollout_worker,
                                   weight_transfer=gates.weight_transfer)
        trainer.train()

TRL calls both from its own (synchronous) thread; everything asynchronous (the gates'
control plane, the sink, the harnesses, the weight push) runs on one event loop in a
thread of its own, an anyio blocking portal that this object starts and stops. It holds a
`tokcap_vllm.GateFleet` (rollouts opened on the gates), a
`tokcap_vllm.weights.FleetWeightSync` (one weight version for every gate), the shared
`Collector`, and between the worker and the transfer one `PolicyVersions`. On exit the
worker is stopped (its collections clean up after themselves: staged calls cleared,
rollouts released), then the fleet's connections are closed, then the loop.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal

from tokcap_core import TokenSink
from tokcap_core.ids import validate_rollout_id
from tokcap_vllm import GateFleet
from tokcap_vllm.weights import FleetWeightSync, PushMode

from ._async_transfer import GateWeightTransfer, PolicyVersions
from ._async_worker import GateRolloutWorker
from ._collect import Collector
from ._errors import TRLAdapterError
from ._harness import Harness, Prompt
from ._portal import PortalScope

__all__ = ["AsyncGRPOGates"]

T = TypeVar("T")


class AsyncGRPOGates(PortalScope):
    """``rollout_worker`` and ``weight_transfer`` for ``AsyncGRPOTrainer`` over gates.

    ``gate_urls`` and ``token``: the fleet (``tokcap-vllm serve`` gates run with
    ``--tokcap-require-open`` and tokcap's weight transport); ``sink``: where they stage
    (the trainer reads rows from it); ``harness`` plays each rollout, ``prompts`` are
    cycled, ``group_size`` rollouts per prompt (TRL's ``num_generations``), ``model`` is
    the name requests carry, ``max_seq_len`` caps a row. ``run_id`` prefixes rollout ids
    (random unless given). ``push_mode`` is the fleet push's (``"wait"``: calls in flight
    finish on the old weights). ``rollout_buffer`` replaces the worker's queue (one that
    records what TRL took, say).
    """

    def __init__(
        self,
        gate_urls: Sequence[str],
        token: str,
        sink: TokenSink,
        harness: Harness,
        prompts: Sequence[Prompt],
        *,
        model: str,
        group_size: int,
        max_seq_len: int,
        max_groups_in_flight: int = 2,
        run_id: str | None = None,
        push_mode: PushMode = "wait",
        rollout_buffer: Any = None,
    ) -> None:
        if not gate_urls:
            raise TRLAdapterError("bad_config", "at least one gate URL")
        self.run_id = run_id or "trl-async-" + secrets.token_hex(4)
        validate_rollout_id(f"{self.run_id}-g0-0")
        self._urls = list(gate_urls)
        self._token = token
        self._sink = sink
        self._harness = harness
        self._prompts = list(prompts)
        self._options = {
            "model": model,
            "group_size": group_size,
            "max_seq_len": max_seq_len,
            "max_groups_in_flight": max_groups_in_flight,
            "push_mode": push_mode,
            "rollout_buffer": rollout_buffer,
        }
        self._worker: GateRolloutWorker | None = None
        self._transfer: GateWeightTransfer | None = None
        self.fleet: GateFleet | None = None
        """The fleet (inside the ``with``): its rollouts, its gates' reports."""
        self.weights: FleetWeightSync | None = None
        """The fleet's weight sync (inside the ``with``)."""

    @property
    def rollout_worker(self) -> GateRolloutWorker:
        """TRL's ``rollout_worker=`` (inside the ``with``)."""
        if self._worker is None:
            raise TRLAdapterError("not_started", "use AsyncGRPOGates inside its with block")
        return self._worker

    @property
    def weight_transfer(self) -> GateWeightTransfer:
        """TRL's ``weight_transfer=`` (inside the ``with``)."""
        if self._transfer is None:
            raise TRLAdapterError("not_started", "use AsyncGRPOGates inside its with block")
        return self._transfer

    def call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await func(*args)`` on the adapter's event loop, from any other thread (the
        fleet's and the weight sync's methods, say)."""
        if self._portal is None:
            raise TRLAdapterError("not_started", "use AsyncGRPOGates inside its with block")
        return self._portal.call(func, *args)

    def _open(self, stack: contextlib.ExitStack, portal: BlockingPortal) -> None:
        options = self._options
        fleet = portal.call(GateFleet, self._urls, self._token)
        stack.enter_context(portal.wrap_async_context_manager(fleet))
        weights = portal.call(
            lambda: FleetWeightSync(
                [(url, self._token) for url in self._urls], mode=options["push_mode"]
            )
        )
        stack.enter_context(portal.wrap_async_context_manager(weights))
        group_size: int = options["group_size"]
        in_flight: int = options["max_groups_in_flight"]
        collector = Collector(
            fleet,
            self._sink,
            model=options["model"],
            max_seq_len=options["max_seq_len"],
            concurrency=group_size * in_flight,
        )
        versions = PolicyVersions()
        self._transfer = GateWeightTransfer(weights, portal.call, versions)
        self._worker = GateRolloutWorker(
            collector,
            self._harness,
            self._prompts,
            group_size=group_size,
            run_id=self.run_id,
            portal=portal,
            versions=versions,
            max_groups_in_flight=in_flight,
            rollout_buffer=options["rollout_buffer"],
        )
        stack.callback(self._worker.stop)
        self.fleet, self.weights = fleet, weights

    def _forget(self) -> None:
        self._worker = self._transfer = None
        self.fleet = self.weights = None
