"""Building a tokcap stack on one machine: the services, the gate, the pool, the clients.

`services` brings up a loopback Ray + TransferQueue (or attaches to a Ray cluster) and
launches an in-process gate once Ray is up; `open_stack` starts the Ray reassembler pool
and opens the control plane over the stack's gates, and hands back a `Stack`: what a
trainer composes (`collect`, `finish`). Gates are taken abstractly (`GateEndpoint`: a base
URL and a rollout URL; `ControlPlane`: a client), so one in-process gate and a fleet of
gate servers elsewhere compose the same way.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from tokcap_core import CaptureConfig, ConfigError
from tokcap_ray import ReassemblerPool
from tokcap_tq import TQSink, TQSinkConfig, connect_tq, local_tq
from tokcap_vllm import ControlPlaneClient, Gate, GateConfig, InProcessServer

from ._trainer import Batch, ControlPlane, Finished, FinishTimings, collect, finish

__all__ = [
    "GateEndpoint",
    "Stack",
    "StageHook",
    "in_process_gate",
    "open_stack",
    "services",
    "tq_sink",
]

SERVER_THREAD = "tokcap-vllm-server"  # the name InProcessServer gives its thread

StageHook = Callable[[str], AbstractContextManager[Any]]
"""``stage(label)`` → a context manager around one start-up stage (e.g. a progress line)."""


class GateEndpoint(Protocol):
    """A gate as a harness sees it: the model it serves and where each rollout calls it.

    `tokcap_vllm.InProcessServer` is one; so is any gate server reached by URL.
    """

    @property
    def model(self) -> str:
        """The served model's name (the ``model`` field of requests)."""
        ...

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the gate's server (its control plane is under it)."""
        ...

    def rollout_url(self, rollout_id: str) -> str:
        """The OpenAI base URL a harness uses for ``rollout_id``."""
        ...


def tq_sink(tag: str) -> TQSink:
    """The TransferQueue sink of a run tagged ``tag``: partitions ``<tag>_staging``,
    ``<tag>_rows`` and ``<tag>_media`` (dashes become underscores)."""
    tag = tag.replace("-", "_")
    return TQSink(
        TQSinkConfig(
            staging_partition=f"{tag}_staging",
            training_partition=f"{tag}_rows",
            media_partition=f"{tag}_media",
        )
    )


def in_process_gate(
    model: str,
    *,
    capture: CaptureConfig,
    sink: TQSink,
    vllm_args: Sequence[str],
    parent_commit_timeout_s: float = 60.0,
) -> InProcessServer:
    """vLLM's OpenAI server for ``model`` with a gate staging into ``sink`` (not started:
    `services` launches it)."""
    gate = Gate(
        GateConfig(parent_commit_timeout_s=parent_commit_timeout_s, capture=capture), sink=sink
    )
    return InProcessServer(model, gate=gate, vllm_args=vllm_args)


@contextlib.contextmanager
def services(
    server: InProcessServer | None,
    *,
    workers: int,
    ray_address: str | None = None,
    stage: StageHook | None = None,
) -> Iterator[None]:
    """Start a loopback Ray + TransferQueue (room for ``workers`` pool actors), or connect to
    the cluster at ``ray_address`` and start TransferQueue on it, and launch ``server`` (if
    any: gates elsewhere need none) as soon as Ray is up, so its engine builds while
    TransferQueue starts; on exit stop the engine, then TransferQueue and Ray (a cluster
    given by address keeps running).

    Not before Ray's node is up: Ray 2.60's raylet gives its dashboard agent 15 s to report
    its ports and aborts the start when it is late, and on a loaded 2-core box an engine
    building at the same moment made it late in 6 of 7 starts (load 10-30); a start that
    failed so is tried once more (the agent's imports are in the page cache by then).
    `InProcessServer.wait_ready` is the caller's (`open_stack` overlaps it with the pool's
    start).
    """
    where = f"connect to Ray at {ray_address}" if ray_address else "start Ray"
    label = f"{where} + TransferQueue (vLLM building)"
    with tempfile.TemporaryDirectory(prefix="tokcap-") as tmp, contextlib.ExitStack() as ray:
        with stage(label) if stage is not None else contextlib.nullcontext():
            cancel, launched = threading.Event(), threading.Event()
            launcher = threading.Thread(
                target=_launch_once_ray_is_up, args=(server, cancel, launched)
            )
            launcher.start()
            try:
                if ray_address:
                    ray.enter_context(connect_tq(ray_address, init_timeout_s=300.0))
                else:
                    _enter_local_tq(ray, tmp, workers)
            except BaseException:
                cancel.set()
                launcher.join()
                if launched.is_set() and server is not None:
                    _stop(server)
                raise
            launcher.join()
        try:  # the engine and its sink writes stop before TransferQueue does
            yield
        finally:
            if server is not None:
                _stop(server)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack:
    """A running stack as a trainer uses it: gates, their control plane, sink and pool."""

    gates: tuple[GateEndpoint, ...]
    control: ControlPlane
    """The control plane over every gate (closes, receipts, releases)."""
    sink: TQSink
    pool: ReassemblerPool
    capture: CaptureConfig

    @property
    def gate(self) -> GateEndpoint:
        """The stack's gate, when it has exactly one."""
        if len(self.gates) != 1:
            raise ConfigError("bad_gates", f"{len(self.gates)} gates: route by rollout id")
        return self.gates[0]

    async def collect(self, finished: Sequence[Finished]) -> Batch:
        """`collect` on this stack."""
        return await collect(self.control, self.pool, self.sink, finished, self.capture)

    async def finish(self, batch: Batch) -> FinishTimings:
        """`finish` on this stack."""
        return await finish(self.control, self.sink, batch)


@contextlib.asynccontextmanager
async def open_stack(
    gates: Sequence[GateEndpoint],
    *,
    sink: TQSink,
    capture: CaptureConfig,
    workers: int,
    control: ControlPlane | None = None,
    alongside: Sequence[Callable[[], Coroutine[Any, Any, object]]] = (),
    stage: StageHook | None = None,
    label: str = "start vLLM + gate, Ray pool",
) -> AsyncIterator[Stack]:
    """Start the Ray reassembler pool (``workers`` actors reading ``sink``) and open the
    control plane; yield the `Stack`; on exit close the client and the pool.

    ``control`` defaults to a `tokcap_vllm.ControlPlaneClient` on the one gate (with the
    capture's control token); several gates need a client that routes between them.
    ``alongside``: start-up work run concurrently with the pool's start, such as waiting
    for an in-process gate's engine; all of it runs inside ``stage(label)``.
    """
    if control is None and len(gates) != 1:
        raise ConfigError("bad_gates", f"{len(gates)} gates need a routing control plane")
    factory = functools.partial(TQSink.connect, sink.config)
    pool = ReassemblerPool(workers, factory, num_cpus=1.0)
    try:
        with stage(label) if stage is not None else contextlib.nullcontext():
            async with anyio.create_task_group() as tg:
                for work in alongside:
                    tg.start_soon(work)
                await pool.start()
        async with contextlib.AsyncExitStack() as clients:
            if control is None:
                assert capture.control_token is not None
                control = await clients.enter_async_context(
                    ControlPlaneClient(gates[0].base_url, capture.control_token)
                )
            yield Stack(gates=tuple(gates), control=control, sink=sink, pool=pool, capture=capture)
    finally:
        with anyio.CancelScope(shield=True):
            pool.close()


def _enter_local_tq(stack: contextlib.ExitStack, tmp: str, workers: int) -> None:
    """Enter `local_tq` on ``stack``; once more if Ray's node timed out starting.

    TransferQueue's start gets 300 s, not 120: on a loaded 2-core box it took longer.
    """
    start = functools.partial(local_tq, tmp, storage_units=1, extra_cpus=workers)
    try:
        stack.enter_context(start(init_timeout_s=300.0))
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        stack.enter_context(start(init_timeout_s=300.0))


def _launch_once_ray_is_up(
    server: InProcessServer | None, cancel: threading.Event, launched: threading.Event
) -> None:
    import ray

    while server is not None and not cancel.is_set():
        if ray.is_initialized():
            server.launch()
            launched.set()
            return
        time.sleep(0.05)


def _stop(server: InProcessServer, timeout_s: float = 180.0) -> None:
    """Stop the server, also when Ctrl-C came while its engine was still being built.

    `InProcessServer.stop` can only ask a server that is already up to exit, so ask again
    until the server's thread has ended.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.stop(timeout=2.0)
        if not any(t.name == SERVER_THREAD and t.is_alive() for t in threading.enumerate()):
            return
