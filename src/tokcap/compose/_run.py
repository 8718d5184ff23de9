"""A run on its placement: the services and gates it starts, then the stack and the pushes.

`place` starts, by the run's `Placement`, what the process holds for the run: Ray and
TransferQueue (`services`) and the gates, either one in this process (`in_process_gate`,
launched as soon as Ray is up, so its engine builds while TransferQueue starts) or a fleet
of ``tokcap-vllm serve`` gates (`fleet_gates`: started here, or taken by URL). It yields a
`Site`; `Site.open`, on the run's event loop, opens what a trainer uses on those gates and
yields a `Run`: its `Stack` (the Ray pool, the control plane: `collect`, `finish`), its
fleet (None in process) and `Run.push`, the trainer's weights into every engine::

    with place(placement, sink, capture, vllm_args=QWEN_VLLM_ARGS, push_mode="wait") as site:
        anyio.run(train, site)

    async def train(site: Site) -> None:
        async with site.open() as run:
            for step in range(steps):
                ...  # play, run.stack.collect, your optimizer step
                await run.push(trainer)

Two steps because Ray must start on the main thread, outside the event loop (its SIGTERM
handler), while the pool, the clients and the weight syncs live on the loop.

In process, a run that pushes weights (``push_mode``) starts its engine with
`tokcap_vllm.WeightSyncWorker` and pushes through a `tokcap_vllm.WeightSync` its gate
watches. Over a fleet, every rollout is opened through a `tokcap_vllm.GateFleet` (the gate
with the fewest open rollouts); gates someone else started are first cleared of what a
dead run left (`reclaim_rollouts`); pushes go through a `FleetWeightSync` to the gates that
still answer (`push_to_live_gates`, every gate probed first: `drop_dead_gates`), and a
lost gate's version is reported as None. A fleet that pushes must start with every gate
at one version (`ConfigError` ``bad_gates``).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from tokcap_core import CaptureConfig, ConfigError, TokcapError
from tokcap_tq import TQSink
from tokcap_vllm import GateFleet, InProcessServer, WeightSync
from tokcap_vllm.weights import FleetWeightSync, PushMode

from ._fleet import (
    FleetGate,
    drop_dead_gates,
    fleet_gates,
    fleet_token,
    gate_entries,
    gate_versions,
    push_to_live_gates,
    served_model,
)
from ._served import FleetEndpoint, reclaim_rollouts
from ._stack import Stack, StageHook, in_process_gate, open_stack, services

if TYPE_CHECKING:
    import torch

__all__ = [
    "WEIGHT_SYNC_ARGS",
    "FleetRun",
    "Placement",
    "Policy",
    "Pushed",
    "Run",
    "Site",
    "place",
]

WEIGHT_SYNC_ARGS = ("--worker-extension-cls", "tokcap_vllm.WeightSyncWorker")
"""What an in-process engine that takes weight pushes is started with (`place`)."""

_Alongside = Sequence[Callable[[], Coroutine[Any, Any, object]]]


class Placement(Protocol):
    """Where a run's gates and services are: what `tokcap demo`'s and `tokcap train`'s
    configs both say (`place`)."""

    @property
    def model(self) -> Path:
        """The model the started gates serve."""
        ...

    @property
    def gates(self) -> int:
        """How many gates to start (0: take ``gate_urls``, or none: one gate in process)."""
        ...

    @property
    def gate_urls(self) -> tuple[str, ...]:
        """Gates someone else started."""
        ...

    @property
    def ray_address(self) -> str | None:
        """An existing Ray cluster (None: start one here)."""
        ...

    @property
    def workers(self) -> int:
        """The Ray reassembler pool's actors."""
        ...


class Policy(Protocol):
    """What `Run.push` pushes: a trainer's weight version and, once it moved, its weights
    (`tokcap.train.Trainer` is one)."""

    @property
    def version(self) -> int:
        """The version of the weights it holds."""
        ...

    def weights(self) -> Mapping[str, torch.Tensor]:
        """Its full state dict."""
        ...


@dataclass(frozen=True, slots=True)
class Pushed:
    """After a push: the engine's version label, and each served gate's version."""

    label: str
    gate_versions: tuple[int, ...] = ()


class Run:
    """A run opened on its placement (`Site.open`): its stack, its fleet, its weight pushes."""

    def __init__(self, stack: Stack, fleet: GateFleet | None, version: int) -> None:
        self.stack = stack
        self.fleet = fleet
        """Served gates: open each rollout through it before it plays (None in process)."""
        self.version = version
        """The engines' weight version when the run opened (0 for a run that pushes none)."""

    async def push(self, policy: Policy) -> Pushed:
        """``policy``'s weights into every engine if its version moved; the versions after."""
        raise ConfigError("bad_push_mode", "this run was placed without a push_mode")

    async def gate_entries(self, calls: Mapping[str, int]) -> list[dict[str, Any]]:
        """``summary.json``'s ``gates`` (`gate_entries`; none in process)."""
        return []


class _InProcessRun(Run):
    """The run's one gate in this process; pushes through its engine's `WeightSync`."""

    def __init__(
        self, stack: Stack, server: InProcessServer, sync: WeightSync | None, mode: PushMode
    ) -> None:
        super().__init__(stack, None, sync.state.version if sync is not None else 0)
        self._server, self._sync, self._mode = server, sync, mode

    async def push(self, policy: Policy) -> Pushed:
        if self._sync is None:
            return await super().push(policy)
        return Pushed(await anyio.to_thread.run_sync(self._push, self._sync, policy))

    def _push(self, sync: WeightSync, policy: Policy) -> str:
        """In a worker thread: push if the version moved; the engine's version label after."""
        server = self._server
        if policy.version > sync.state.version:
            push = functools.partial(sync.push, mode=self._mode)
            server.call(push, policy.weights(), policy.version, timeout=600)
        return str(server.call(server.engine_client.get_weight_version))


class FleetRun(Run):
    """The run's served gates: a `GateFleet` and the `FleetWeightSync` over them."""

    def __init__(
        self,
        stack: Stack,
        fleet: GateFleet,
        weights: FleetWeightSync,
        gates: Sequence[FleetGate],
        version: int,
        pushes: bool,
    ) -> None:
        super().__init__(stack, fleet, version)
        self.weights = weights
        self.gates = list(gates)
        self._pushes = pushes
        self._pushed = version

    async def push(self, policy: Policy) -> Pushed:
        if not self._pushes:
            return await super().push(policy)
        assert self.fleet is not None
        if policy.version > self._pushed:
            await drop_dead_gates(self.fleet, self.weights)
            await push_to_live_gates(self.fleet, self.weights, policy.weights(), policy.version)
            self._pushed = policy.version
        return await _pushed(self.fleet, self.weights)

    async def gate_entries(self, calls: Mapping[str, int]) -> list[dict[str, Any]]:
        """`gate_entries` now, with every live gate's `gate_versions`."""
        assert self.fleet is not None
        versions = await gate_versions(self.fleet, self.weights)
        return gate_entries(self.fleet, self.gates, calls, versions)


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """A placement whose services and gates are up (`place`); `open` it on the run's loop."""

    placement: Placement
    sink: TQSink
    capture: CaptureConfig
    push_mode: PushMode | None
    server: InProcessServer | None
    """The gate in this process (None: a fleet)."""
    gates: tuple[FleetGate, ...] = ()
    token: str | None = None
    """The fleet's control token."""
    stage: StageHook | None = None
    log: Callable[[str], None] | None = None

    @property
    def label(self) -> str:
        """What `open` shows while it starts the pool (and waits for an in-process engine)."""
        return "start vLLM + gate, Ray pool" if self.server is not None else "Ray pool"

    @contextlib.asynccontextmanager
    async def open(self, *, alongside: _Alongside = (), label: str = "") -> AsyncIterator[Run]:
        """`open_stack` on the site's gates (with ``alongside``, inside ``stage(label)``;
        default `label`) and its weight sync; yield the `Run`; close everything on exit."""
        label = label or self.label
        if self.server is None:
            async with self._fleet(alongside, label) as run:
                yield run
            return
        server = self.server
        ready = functools.partial(anyio.to_thread.run_sync, server.wait_ready)
        async with open_stack(
            [server],
            sink=self.sink,
            capture=self.capture,
            workers=self.placement.workers,
            alongside=[ready, *alongside],
            stage=self.stage,
            label=label,
        ) as stack:
            sync = None
            if self.push_mode is not None:
                sync = await anyio.to_thread.run_sync(server.call, _watched_sync, server)
            yield _InProcessRun(stack, server, sync, self.push_mode or "wait")

    @contextlib.asynccontextmanager
    async def _fleet(self, alongside: _Alongside, label: str) -> AsyncIterator[FleetRun]:
        placement, token = self.placement, self.token
        assert token is not None
        urls = [g.url for g in self.gates]
        async with (
            GateFleet(urls, token) as fleet,
            FleetWeightSync([(url, token) for url in urls], mode=self.push_mode or "wait") as ws,
        ):
            if placement.gate_urls:  # gates that outlive runs: take back what a dead one held
                reclaimed = await reclaim_rollouts(urls, token, self.sink, owner=fleet.owner)
                if self.log is not None:
                    self.log(f"reclaimed rollouts a previous run left: {reclaimed}")
            model = await served_model(urls[0]) if placement.gate_urls else str(placement.model)
            async with open_stack(
                [FleetEndpoint(fleet, model, urls)],
                sink=self.sink,
                capture=self.capture,
                workers=placement.workers,
                control=fleet,
                alongside=alongside,
                stage=self.stage,
                label=label,
            ) as stack:
                version = 0
                if self.push_mode is not None:
                    start = await _pushed(fleet, ws)
                    if len(set(start.gate_versions)) != 1:
                        raise ConfigError("bad_gates", f"gates at different versions: {start}")
                    version = start.gate_versions[0]
                yield FleetRun(stack, fleet, ws, self.gates, version, self.push_mode is not None)


@contextlib.contextmanager
def place(
    placement: Placement,
    sink: TQSink,
    capture: CaptureConfig,
    *,
    vllm_args: Sequence[str],
    push_mode: PushMode | None = None,
    gate_options: Sequence[str] = (),
    stage: StageHook | None = None,
    log: Callable[[str], None] | None = None,
) -> Iterator[Site]:
    """Start the run's services and gates (see the module); yield its `Site`; stop them on
    exit (the engines and gates first, then TransferQueue and Ray).

    ``vllm_args`` serve ``placement.model`` on every started gate; ``gate_options`` are added
    to a served gate's (`served_gate_options`); ``push_mode`` (None: the run pushes no
    weights) is how `Run.push` treats calls in flight. ``stage`` shows each start-up stage,
    ``log`` what was reclaimed from gates someone else started. Raises `ConfigError`
    ``bad_gates`` for ``gate_urls`` with ``gates`` or without ``ray_address``, and
    ``token_env_missing`` (`fleet_token`).
    """
    if placement.gate_urls and (placement.gates or not placement.ray_address):
        raise ConfigError(
            "bad_gates", "--gate URL needs --ray-address and no --gates (they are started)"
        )
    site = functools.partial(
        Site, placement=placement, sink=sink, capture=capture, push_mode=push_mode, stage=stage
    )
    workers, address = placement.workers, placement.ray_address
    if not (placement.gates or placement.gate_urls):
        args = [*vllm_args, *WEIGHT_SYNC_ARGS] if push_mode is not None else vllm_args
        server = in_process_gate(str(placement.model), capture=capture, sink=sink, vllm_args=args)
        with services(server, workers=workers, ray_address=address, stage=stage):
            yield site(server=server)
        return
    token = fleet_token(placement.gate_urls, capture)
    with (
        services(None, workers=workers, ray_address=address, stage=stage),
        tempfile.TemporaryDirectory(prefix="tokcap-gates-") as logs,
        fleet_gates(
            placement.model,
            count=placement.gates,
            urls=placement.gate_urls,
            sink=sink.config,
            token=token,
            vllm_args=vllm_args,
            log_dir=Path(logs),
            gate_options=gate_options,
            stage=stage,
        ) as gates,
    ):
        yield site(server=None, gates=tuple(gates), token=token, log=log)


async def _watched_sync(server: InProcessServer) -> WeightSync:
    """On the server's loop: a `WeightSync` for its engine, watched by its gate."""
    sync = await WeightSync.connect(server.engine_client)
    server.gate.watch_weights(sync)
    return sync


async def _pushed(fleet: GateFleet, weights: FleetWeightSync) -> Pushed:
    """Every live gate's version now; the label is the engines' one label (else all). A
    gate that stopped answering since the push is dropped first."""
    try:
        infos = await weights.infos()
    except TokcapError:
        await drop_dead_gates(fleet, weights)
        infos = await weights.infos()
    labels = sorted({info.engine_version for info in infos})
    return Pushed(
        labels[0] if len(labels) == 1 else "|".join(labels),
        tuple(info.version for info in infos),
    )
