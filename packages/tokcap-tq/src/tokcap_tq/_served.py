"""The ``tq`` sink of a served gate (``tokcap-vllm serve --tokcap-sink tq``).

Registered under the entry-point group ``tokcap.sinks`` (`tokcap_core.sink.SinkPlugin`),
so tokcap-vllm never imports this package. The gate's server process joins the Ray
cluster at ``ray_address`` as a driver and attaches to the TransferQueue the trainer side
runs there (`connect_tq`, `local_tq`). A gate never starts or owns TransferQueue: a dead
gate must not take the fleet's sink down, so it only waits, retrying within
``attach_timeout_s`` and logging each wait, until the controller is up; on exit it leaves
Ray without closing TransferQueue (``tq.close`` would kill the controller).

Gates outlive trainers, and the trainer that started TransferQueue closes it on exit. So
while the gate serves, a watcher (a thread, every `WATCH_S` seconds) asks Ray for the
controller by name: gone, and every sink this plugin made says so (``problem``, read by the
gate before each captured call: 503 ``sink_unavailable``, and by its health); a controller
other than the one attached to (the next trainer's TransferQueue), and the gate attaches
to it as at start (``tq.init`` finds it), then the sinks take calls again. No restart, no
route to call: the trainer's `connect_tq` is all it takes. TransferQueue keeps its client
in module globals; attaching again drops the old client without closing it (closing is
not safe while an operation may hold its sockets: one client's sockets are left per
re-attach). Calls that were staging when the old TransferQueue went fail as before
(``stage_failed:timeout``, their rollouts poisoned); the rows they staged went with it.
The Ray cluster itself is not re-joined: a gate whose cluster is gone stays unavailable.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import anyio
import attrs

from tokcap_core import SinkError
from tokcap_core.config import non_empty_text, positive_number

from ._cluster import _on_loopback
from ._deps import ray, tq
from ._local import loopback_env
from ._sink import TQSink, TQSinkConfig

__all__ = ["WATCH_S", "TQAttachConfig", "TQSinkPlugin", "plugin"]

_log = logging.getLogger("tokcap_tq.served")
_RETRY_S = 2.0
_LOG_EVERY_S = 10.0
WATCH_S: Final = 1.0
"""How often a served gate asks Ray whether its TransferQueue is still the one attached."""
_CONTROLLER = ("TransferQueueController", "transfer_queue")


@attrs.frozen(kw_only=True)
class TQAttachConfig:
    """Where a served gate finds TransferQueue: the Ray cluster it joins as a driver."""

    ray_address: str = attrs.field(validator=non_empty_text)
    """The cluster's GCS address, ``HOST:PORT`` (what ``ray start --head`` prints)."""
    attach_timeout_s: float = attrs.field(default=300.0, validator=positive_number)
    """How long the gate waits for Ray and TransferQueue before it gives up starting."""


class TQSinkPlugin:
    """`tokcap_core.sink.SinkPlugin` for TransferQueue (see the module docstring)."""

    config_types: tuple[type[Any], ...] = (TQSinkConfig, TQAttachConfig)

    def __init__(self) -> None:
        self._sinks: weakref.WeakSet[TQSink] = weakref.WeakSet()

    def sink(self, configs: Sequence[Any]) -> TQSink:
        """A `TQSink` over the configured partitions (nothing is connected yet); it reports
        this process's attachment (see the module)."""
        sink_config, _ = configs
        made = TQSink(sink_config)
        self._sinks.add(made)
        return made

    def _report(self, problem: str | None) -> None:
        for made in list(self._sinks):
            made.problem = problem

    @contextlib.asynccontextmanager
    async def attach(self, configs: Sequence[Any]) -> AsyncIterator[None]:
        """Join the cluster and attach to its TransferQueue for the gate's lifetime,
        attaching again whenever it is replaced (see the module)."""
        _, attach = configs
        with contextlib.ExitStack() as env:
            if _on_loopback(attach.ray_address):
                env.enter_context(loopback_env())
            attached = await anyio.to_thread.run_sync(_join, attach)
            stop = threading.Event()
            watcher = threading.Thread(
                target=self._watch, args=(attached, stop), name="tokcap-tq-watch", daemon=True
            )
            watcher.start()
            try:
                yield
            finally:
                stop.set()
                await anyio.to_thread.run_sync(watcher.join)
                ray.shutdown()  # leaves the cluster; TransferQueue keeps running

    def _watch(self, attached: str, stop: threading.Event) -> None:
        """Follow the cluster's TransferQueue until ``stop`` (the thread's body)."""
        while not stop.wait(WATCH_S):
            try:
                current = _controller_id()
                if current is None:
                    self._report("no TransferQueue on the cluster (its trainer closed it?)")
                elif current != attached:
                    self._report("attaching to a new TransferQueue")
                    if _configured():
                        _attach_again()
                        attached = current
                        _log.warning("tokcap: attached to a new TransferQueue (%s)", current)
                        self._report(None)
                else:
                    self._report(None)
            except Exception as e:  # Ray unreachable, an actor dying under the call, ...
                self._report(f"TransferQueue unreachable: {type(e).__name__}: {e}"[:300])


def _controller_id() -> str | None:
    """The id of the cluster's TransferQueue controller now (None: there is none)."""
    name, namespace = _CONTROLLER
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    return str(handle._actor_id.hex())


def _attach_again() -> None:
    """Drop this process's TransferQueue client and attach to the running controller
    (TransferQueue keeps both in module globals; see the module for why not closed)."""
    from transfer_queue import interface  # type: ignore[import-untyped]

    interface._TQ_CLIENT = None
    interface._TQ_CONTROLLER = None
    tq.init()


def _join(attach: TQAttachConfig) -> str:
    """Connect to Ray, wait for the TransferQueue controller, attach a client (blocking);
    the controller's id."""
    started = time.monotonic()
    deadline = started + attach.attach_timeout_s
    logged = -_LOG_EVERY_S
    last: str = ""
    while True:
        try:
            if not ray.is_initialized():
                if not _listening(attach.ray_address):
                    raise ConnectionRefusedError("nothing listens there yet")
                ray.init(address=attach.ray_address, log_to_driver=False, configure_logging=False)
            controller = _controller_id()
            if controller is not None and _configured():
                tq.init()  # the controller exists: this attaches a client, starts nothing
                _log.warning(
                    "tokcap: attached to TransferQueue on the Ray cluster at %s",
                    attach.ray_address,
                )
                return controller
            last = "no TransferQueue controller on the cluster yet"
        except Exception as e:  # Ray raises many kinds while a cluster comes up; retried, bounded
            last = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        if now >= deadline:
            raise SinkError(
                "tq_attach_timeout",
                f"no TransferQueue on the Ray cluster at {attach.ray_address} after "
                f"{attach.attach_timeout_s:.0f} s ({last}); start it on the trainer side "
                "(tokcap_tq.connect_tq) before the gates",
            )
        if now - logged >= _LOG_EVERY_S:
            logged = now
            _log.warning(
                "tokcap: waiting for TransferQueue on the Ray cluster at %s (%s; %.0f of %.0f s)",
                attach.ray_address,
                last,
                now - started,
                attach.attach_timeout_s,
            )
        time.sleep(min(_RETRY_S, max(0.0, deadline - now)))


def _listening(address: str) -> bool:
    """Whether the GCS port accepts connections: ``ray.init`` on a cluster that is not up
    retries inside itself for minutes, past any deadline of ours."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():  # "auto", "ray://...": Ray resolves it
        return True
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_RETRY_S):
            return True
    except (OSError, ValueError):
        return False


def _configured() -> bool:
    """Whether the controller has stored its config (``tq.init`` would block until then)."""
    controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    return ray.get(controller.get_config.remote(), timeout=_RETRY_S * 5) is not None


plugin = TQSinkPlugin()
"""The entry point's object (``tokcap.sinks``: ``tq``)."""
