"""`local_tq`: a loopback-only local Ray + TransferQueue for tests, benchmarks and the demo.

Loopback binding: Ray resolves ``127.0.0.1`` to the host's outward address unless
multi-node clustering is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); with it off, the
node IP is ``127.0.0.1``, so GCS, raylet, workers and TQ's ZMQ sockets (which bind on
Ray's node IP) all listen on loopback. The variable is set for the cluster's lifetime and
inherited by every Ray process; ``ss -ltnp`` in the tests checks the result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from tokcap_core import SinkError
from tokcap_core.config import at_least, positive_number

from ._deps import ray, tq

__all__ = ["WORKER_RUNTIME_ENV", "LocalTQ", "init_tq", "local_tq", "loopback_env", "short_temp_dir"]

# Ray puts unix sockets at <temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store:
# about 64 characters past <temp>, and a unix socket path must stay under 108 bytes.
_MAX_TEMP_DIR = 40
_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node IP = 127.0.0.1 (see module docstring)
    "RAY_AUTH_MODE": "disabled",  # no ~/.ray/auth_token
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",  # workers must not re-run `uv run`
    "TQ_NUM_THREADS": "2",  # silences a warning TQ logs on every op
}

WORKER_RUNTIME_ENV: dict[str, Any] = {"env_vars": {"RAY_worker_niceness": "0"}}
"""The job's runtime env for every Ray worker a trainer starts (TransferQueue's controller
and storage units, the reassembler pool): normal priority. Ray starts workers at nice 15
by default; beside vLLM servers and other busy processes at nice 0, a nice-15 worker
importing TransferQueue (~10 s of CPU) got ~1 % of a loaded 2-core box and ``tq.init``
timed out. Ray reads the variable in each worker at start-up."""


@attrs.frozen(kw_only=True)
class LocalTQ:
    """A running local cluster: where Ray keeps its files and how many logical CPUs it has."""

    temp_dir: Path
    """Ray's temp dir (under the caller's path, or a short ``/tmp`` fallback; see `local_tq`)."""
    num_cpus: int
    storage_units: int
    free_cpus: int
    """CPUs left for other actors (a reassembler pool) after TQ's controller and units."""


def short_temp_dir(tmp_dir: Path) -> tuple[Path, bool]:
    """``tmp_dir/ray`` if short enough for Ray's unix sockets, else a new ``/tmp/tokcap-ray-*``."""
    preferred = Path(tmp_dir).resolve() / "ray"
    if len(str(preferred)) <= _MAX_TEMP_DIR:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred, False
    return Path(tempfile.mkdtemp(prefix="tokcap-ray-", dir="/tmp")), True


@contextmanager
def loopback_env(extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """Ray on 127.0.0.1 for this process and every one it starts (see the module
    docstring), plus ``extra`` variables; the environment is restored on exit."""
    env = {**_ENV, **(extra or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # ray read the flag when it was imported; the services module reads it at call time.
    constants = ray._private.ray_constants
    saved_flag = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def init_tq(storage: Mapping[str, Any], timeout_s: float) -> None:
    """``tq.init`` with SimpleStorage settings ``storage`` and a deadline: it blocks
    forever when Ray cannot place its actors."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            tq.init({"backend": {"SimpleStorage": dict(storage)}})
        except BaseException as e:  # handed to the caller below
            failure.append(e)

    thread = threading.Thread(target=run, name="tokcap-tq-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise SinkError("tq_init_timeout", f"tq.init did not finish within {timeout_s:.0f} s")
    if failure:
        raise SinkError("tq_init_failed", f"tq.init failed: {failure[0]!r}") from failure[0]


@attrs.frozen(kw_only=True)
class _LocalArgs:
    """`local_tq`'s arguments, checked like every config (`ConfigError` ``bad_<name>``)."""

    storage_units: int = attrs.field(validator=at_least(1))
    extra_cpus: int = attrs.field(validator=at_least(0))
    init_timeout_s: float = attrs.field(validator=positive_number)


@contextmanager
def local_tq(
    tmp_dir: str | os.PathLike[str],
    *,
    storage_units: int = 1,
    extra_cpus: int = 0,
    init_timeout_s: float = 300.0,
) -> Iterator[LocalTQ]:
    """Start a local Ray (``1 + storage_units + extra_cpus`` logical CPUs) and TransferQueue.

    Everything listens on 127.0.0.1; dashboard, usage stats and token auth are off. Ray's
    temp dir is ``tmp_dir/ray`` when that path is at most 40 characters (Ray's unix socket
    paths must fit in 107 bytes); otherwise a fresh ``/tmp/tokcap-ray-XXXX`` that is
    removed on exit. Raises `tokcap_core.ConfigError` ``bad_<argument>`` for a bad
    argument, `SinkError` ``ray_running`` if Ray is already initialised in this process,
    ``cluster_too_small`` if Ray reports fewer CPUs than TQ's actors reserve (``tq.init``
    would hang), and ``tq_init_timeout`` instead of hanging. On exit TQ is closed before
    Ray shuts down, and the environment is restored. To use a running cluster instead,
    see `connect_tq`.
    """
    _LocalArgs(storage_units=storage_units, extra_cpus=extra_cpus, init_timeout_s=init_timeout_s)
    if ray.is_initialized():
        raise SinkError(
            "ray_running", "local_tq starts its own Ray; ray is already initialised here"
        )
    with loopback_env():
        temp_dir, owned = short_temp_dir(Path(tmp_dir))
        num_cpus = 1 + storage_units + extra_cpus
        tq_started = False
        try:
            ray.init(
                num_cpus=num_cpus,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                _temp_dir=str(temp_dir),
                log_to_driver=False,
                configure_logging=False,
                runtime_env=WORKER_RUNTIME_ENV,
                # Idle workers prestarted per CPU only slow start-up; actors start their own.
                _system_config={"prestart_worker_first_driver": False},
            )
            cpus = int(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]
            if cpus < 1 + storage_units:
                raise SinkError(
                    "cluster_too_small",
                    f"TQ needs {1 + storage_units} CPUs (controller + {storage_units} storage "
                    f"units); Ray has {cpus}",
                )
            tq_started = True
            init_tq({"num_data_storage_units": storage_units}, init_timeout_s)
            yield LocalTQ(
                temp_dir=temp_dir,
                num_cpus=cpus,
                storage_units=storage_units,
                free_cpus=cpus - 1 - storage_units,
            )
        finally:
            try:
                if tq_started:
                    tq.close()
            finally:
                ray.shutdown()
                if owned:
                    shutil.rmtree(temp_dir, ignore_errors=True)
