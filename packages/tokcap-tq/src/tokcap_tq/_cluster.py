"""TransferQueue on a Ray cluster: `connect_tq` attaches to one at an address;
`local_cluster` starts a multi-node one on this machine's loopback (tests, benchmarks,
trying ``--ray-address`` without a cluster).

`connect_tq` is what a CLI's ``--ray-address`` calls instead of `local_tq`: it connects
this process to the cluster (``ray.init(address=...)``, nothing started, nothing bound
here but the driver's own sockets), then starts TransferQueue on it: the controller
where Ray places it (1 CPU) and ``storage_units`` storage units round-robin over the
alive nodes, or only over nodes offering ``storage_resource`` (a Ray custom resource).
If a TransferQueue is already running on the cluster, it is attached to instead and
left running on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import psutil

from tokcap_core import ConfigError, SinkError
from tokcap_core.config import at_least, non_empty_text, positive_number

from ._deps import ray, tq
from ._local import WORKER_RUNTIME_ENV, init_tq, loopback_env, short_temp_dir

__all__ = ["ClusterNode", "ClusterTQ", "LocalCluster", "NodeSpec", "connect_tq", "local_cluster"]

# A lost node is declared dead after ~1.5 s (Ray's default is ~15 s): on one machine a
# missed health check means the node is gone, not a slow network.
_FAST_DEATH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@attrs.frozen(kw_only=True)
class ClusterTQ:
    """TransferQueue on a cluster this process is connected to (see `connect_tq`)."""

    address: str
    """The cluster's address as given."""
    nodes: int
    """Alive nodes when TransferQueue was started."""
    num_cpus: int
    """Logical CPUs over the whole cluster."""
    storage_units: int
    owned: bool
    """Whether `connect_tq` started this TransferQueue (False: attached to a running one)."""


def _alive_nodes() -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n for n in nodes if n.get("Alive")]


@contextmanager
def connect_tq(
    address: str,
    *,
    storage_units: int = 1,
    storage_resource: str | None = None,
    init_timeout_s: float = 300.0,
) -> Iterator[ClusterTQ]:
    """Connect to the Ray cluster at ``address`` and run TransferQueue on it.

    ``address`` is what ``ray.init(address=...)`` takes (``"host:port"`` of the GCS, or
    ``"auto"``). Raises `ConfigError` (``bad_address``, ``bad_storage_units``,
    ``bad_storage_resource``, ``bad_init_timeout_s``) for bad arguments, `SinkError`
    ``ray_running`` if Ray is already initialised in this process, ``cluster_too_small``
    if no node can hold a storage unit, ``tq_init_timeout`` instead of hanging. On exit
    a TransferQueue this call started is closed (controller and units killed), then this
    process disconnects from Ray; the cluster itself keeps running.
    """
    _ConnectArgs(
        address=address,
        storage_units=storage_units,
        storage_resource=storage_resource,
        init_timeout_s=init_timeout_s,
    )
    if ray.is_initialized():
        raise SinkError("ray_running", "connect_tq connects Ray itself; ray is already initialised")
    with contextlib.ExitStack() as env:
        if _on_loopback(address):
            # Ray names a driver's node by the host's outward address unless told otherwise,
            # and then never reaches a cluster that listens on loopback only.
            env.enter_context(loopback_env())
        yield from _connected(address, storage_units, storage_resource, init_timeout_s)


def _on_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def _connected(
    address: str, storage_units: int, storage_resource: str | None, init_timeout_s: float
) -> Iterator[ClusterTQ]:
    ray.init(
        address=address,
        log_to_driver=False,
        configure_logging=False,
        runtime_env=WORKER_RUNTIME_ENV,  # TransferQueue's actors at normal priority
    )
    owned = False
    try:
        hosts = [
            n
            for n in _alive_nodes()
            if n["Resources"].get("CPU", 0) >= 1
            and (storage_resource is None or n["Resources"].get(storage_resource, 0) > 0)
        ]
        if not hosts:
            raise SinkError(
                "cluster_too_small",
                "no alive node has a CPU"
                + ("" if storage_resource is None else f" and the resource {storage_resource!r}")
                + " for a storage unit",
            )
        owned = not _tq_running()
        init_tq(
            {
                "num_data_storage_units": storage_units,
                "required_node_resource": storage_resource,
            },
            init_timeout_s,
        )
        yield ClusterTQ(
            address=address,
            nodes=len(_alive_nodes()),
            num_cpus=int(ray.cluster_resources().get("CPU", 0)),  # type: ignore[no-untyped-call]
            storage_units=storage_units,
            owned=owned,
        )
    finally:
        try:
            if owned:
                tq.close()
        finally:
            ray.shutdown()


def _tq_running() -> bool:
    try:
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
    except ValueError:
        return False
    return True


@attrs.frozen(kw_only=True)
class _ConnectArgs:
    """`connect_tq`'s arguments, checked like every config (`ConfigError` ``bad_<name>``)."""

    address: str = attrs.field(validator=non_empty_text)
    storage_units: int = attrs.field(validator=at_least(1))
    storage_resource: str | None = attrs.field(validator=attrs.validators.optional(non_empty_text))
    init_timeout_s: float = attrs.field(validator=positive_number)


# ---- a loopback multi-node cluster on this machine -------------------------------------


def _resources(_: object, attribute: attrs.Attribute[Any], value: Mapping[str, float]) -> None:
    for name, amount in value.items():
        if type(name) is not str or not name or name in ("CPU", "GPU", "memory"):
            raise ConfigError("bad_resources", f"resources are custom resources: {name!r}")
        positive_number(None, attribute, amount)


@attrs.frozen(kw_only=True)
class NodeSpec:
    """One node of a `local_cluster`: its logical CPUs and custom resources."""

    num_cpus: int = attrs.field(default=1, validator=at_least(0))
    resources: Mapping[str, float] = attrs.field(factory=dict, validator=_resources)


@attrs.frozen(kw_only=True)
class ClusterNode:
    """A running node of a `local_cluster`."""

    index: int
    """Its position in the ``nodes`` given (0: the head)."""
    node_id: str
    """Ray's node id (hex)."""
    raylet_pid: int
    """The node's raylet: every worker process of the node is its child."""
    spec: NodeSpec


class LocalCluster:
    """A multi-node Ray cluster on this machine (see `local_cluster`)."""

    def __init__(self, cluster: Any, nodes: list[tuple[Any, NodeSpec]], temp_dir: Path) -> None:
        self._cluster = cluster
        self._handles = {i: node for i, (node, _) in enumerate(nodes)}
        self.temp_dir = temp_dir
        """Ray's temp dir for every node."""
        self.nodes: tuple[ClusterNode, ...] = tuple(
            ClusterNode(
                index=i,
                node_id=node.node_id,
                raylet_pid=node.all_processes["raylet"][0].process.pid,
                spec=spec,
            )
            for i, (node, spec) in enumerate(nodes)
        )
        """Every node started, the head first (killed ones included)."""

    @property
    def address(self) -> str:
        """The GCS address to connect to (``ray.init(address=...)``, `connect_tq`)."""
        address: str = self._cluster.address
        return address

    def kill(self, node: ClusterNode) -> None:
        """Kill a worker node's raylet and workers at once (a crashed machine).

        Its workers (the raylet's descendants) get SIGKILL first: left to themselves they
        notice the raylet's death only later and may finish the tasks they hold meanwhile,
        which a crashed machine would not.
        """
        if node.index == 0:
            raise ConfigError("bad_node", "the head node holds the cluster; kill a worker node")
        handle = self._handles.pop(node.index, None)
        if handle is not None:
            with contextlib.suppress(psutil.Error):  # the raylet gone already
                for worker in psutil.Process(node.raylet_pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        worker.kill()
            self._cluster.remove_node(handle, allow_graceful=False)


@contextmanager
def local_cluster(
    tmp_dir: str | os.PathLike[str], nodes: Sequence[NodeSpec]
) -> Iterator[LocalCluster]:
    """Start ``nodes`` as one Ray cluster on 127.0.0.1: ``nodes[0]`` is the head.

    Each node is its own raylet (own CPUs, own resources, own worker processes), as on
    separate machines; everything listens on loopback, no dashboard, no usage stats, no
    token auth; Ray's files go under ``tmp_dir`` (or a short ``/tmp`` folder removed on
    exit, see `local_tq`). A lost node is noticed within about 2 s. This process is not
    connected: use `connect_tq` (or ``ray.init(address=cluster.address)``). On exit
    every node is stopped and the environment restored. Raises `ConfigError`
    ``bad_nodes`` for fewer than one node, `SinkError` ``ray_running`` if Ray is
    initialised here.
    """
    from ray.cluster_utils import Cluster

    if not nodes:
        raise ConfigError("bad_nodes", "a cluster needs at least a head node")
    if ray.is_initialized():
        raise SinkError("ray_running", "start the cluster before connecting to it")
    temp_dir, owned_dir = short_temp_dir(Path(tmp_dir))
    # Ray writes the cluster's address to <RAY_TMPDIR>/ray/ray_current_cluster: keep it here.
    (temp_dir / "ray").mkdir(exist_ok=True)
    with loopback_env({"RAY_TMPDIR": str(temp_dir)}):
        # shutdown_at_exit: each node's processes die with this one (and at its exit).
        cluster = Cluster(shutdown_at_exit=True)
        started: list[tuple[Any, NodeSpec]] = []
        try:
            for index, spec in enumerate(nodes):
                args: dict[str, Any] = {
                    "num_cpus": spec.num_cpus,
                    "resources": dict(spec.resources),
                    "node_ip_address": "127.0.0.1",
                    "temp_dir": str(temp_dir),
                }
                if index == 0:
                    args |= {"include_dashboard": False, "_system_config": _FAST_DEATH}
                started.append((cluster.add_node(**args), spec))
            cluster.wait_for_nodes()
            yield LocalCluster(cluster, started, temp_dir)
        finally:
            cluster.shutdown()  # type: ignore[no-untyped-call]
            _kill_leftovers(temp_dir)
            if owned_dir:
                shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_leftovers(temp_dir: Path) -> None:
    """Kill what a node that failed to start left running (its command line names
    ``temp_dir``, which is this cluster's own): Ray forgets a node whose start failed."""
    marker = str(temp_dir)
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if any(marker in arg for arg in proc.cmdline()):
                proc.kill()
