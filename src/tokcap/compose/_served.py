"""Gates as their own ``tokcap-vllm serve`` OS processes, and the fleet a harness plays on.

`ServedGate` starts one gate with the real CLI (its output into a log file, its own process
group); `served_gates` starts N at once, waits until all answer and stops them on exit;
`served_gate_options` are the flags that attach a gate to a run's TransferQueue on Ray and
let a trainer in another process push weights (vLLM's weight-transfer API, tokcap's
``tokcap_shm`` backend). `FleetEndpoint` is a `GateEndpoint` over a `tokcap_vllm.GateFleet`:
each rollout's URL is on the gate the fleet opened it on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import (
    ControlConflict,
    ControlNotFound,
    ControlPlaneClient,
    GateFleet,
)

__all__ = [
    "PORT_TRIES",
    "SERVED_ENV",
    "FleetEndpoint",
    "ServedGate",
    "free_port",
    "reclaim_rollouts",
    "served_gate_options",
    "served_gates",
]

SERVED_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30",
}
"""What every served gate's environment adds: vLLM's RL routes (the weight pushes) and its
engine core in its own process, as the served weight-push tests run it (a trainer process
started by ``tokcap`` has set the in-process default, 0, that its children would inherit).
The keep-alive outlives the clients' (httpx keeps an idle connection 5 s, vLLM's uvicorn by
default 5 s too): with equal timeouts a request sent on a connection the server is closing
gets a reset (``ReadError``), which a trainer takes for a dead gate."""


PORT_TRIES = 3
"""How many ports a gate whose port was chosen for it is started on before it gives up."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def served_gate_options(sink: TQSinkConfig, ray_address: str) -> list[str]:
    """The gate flags of a run's fleet: stage into ``sink``'s partitions of the
    TransferQueue on the Ray cluster at ``ray_address``, refuse rollouts nobody opened,
    take weight pushes from another process through shared memory."""
    return [
        "--tokcap-sink", "tq",
        "--tokcap-ray-address", ray_address,
        "--tokcap-staging-partition", sink.staging_partition,
        "--tokcap-training-partition", sink.training_partition,
        "--tokcap-media-partition", sink.media_partition,
        "--tokcap-require-open",
        "--weight-transfer-config", json.dumps({"backend": "tokcap_shm"}),
    ]  # fmt: skip


class ServedGate:
    """One ``tokcap-vllm serve MODEL *options`` OS process on 127.0.0.1; output to ``log``.

    The control token goes through the environment (``TOKCAP_CONTROL_TOKEN``), never argv.
    A port chosen here (``port=0``) is free when chosen, but another process can take it
    before the gate binds it (any outgoing connection's local port, say): a gate that exits
    with ``Address already in use`` is started again on another port, up to `PORT_TRIES`
    ports in all, by `wait_healthy`.
    """

    def __init__(
        self,
        model: str | Path,
        options: Sequence[str],
        *,
        token: str,
        log: Path,
        port: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.log = log
        self.ports_tried = 1
        """How many ports this gate was started on (more than 1: its port was taken)."""
        self._options = list(options)
        self._environ = {**os.environ, **(env or {}), "TOKCAP_CONTROL_TOKEN": token}
        self._chosen = not port
        self._log_start = 0
        """Where this start's output begins in ``log`` (set by `_launch`)."""
        self.port = port or free_port()
        self.process = self._launch()

    def _launch(self) -> subprocess.Popen[bytes]:
        command = [
            str(Path(sys.executable).with_name("tokcap-vllm")),
            "serve", self.model, *self._options,
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        again = self.ports_tried > 1
        self._log_start = self.log.stat().st_size if again else 0
        with self.log.open("ab" if again else "wb") as out:
            if again:
                out.write(f"[tokcap] port taken: started again on {self.port}\n".encode())
            return subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._environ,
                start_new_session=True,
            )

    def _port_taken(self) -> bool:
        """The gate exited because the port chosen for it was taken meanwhile."""
        if not self._chosen or self.ports_tried >= PORT_TRIES:
            return False
        with self.log.open("rb") as f:
            f.seek(self._log_start)
            return b"Address already in use" in f.read()

    @property
    def pid(self) -> int:
        """The gate's process id (the leader of its process group)."""
        return self.process.pid

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, token: str, timeout_s: float = 600.0) -> None:
        """Wait until ``/tokcap/v1/health`` answers 200 (raise with the log if it died; a
        gate whose chosen port was taken is started again on another)."""
        deadline = time.monotonic() + timeout_s
        headers = {"authorization": f"Bearer {token}"}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._port_taken():
                    self.ports_tried += 1
                    self.port = free_port()
                    self.process = self._launch()
                    continue
                raise RuntimeError(f"gate exited {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/tokcap/v1/health", headers=headers).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"gate not healthy after {timeout_s} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last lines of the gate's output."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the whole process group (the API server and its engine core)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def served_gates(
    model: str | Path,
    count: int,
    options: Sequence[str],
    *,
    token: str,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900.0,
) -> Iterator[list[ServedGate]]:
    """Start ``count`` gates at once (logs ``log_dir/gate<i>.log``; `SERVED_ENV` added to
    their environment), wait until every one answers, yield them; stop them all on exit."""
    started: list[ServedGate] = []
    try:
        for i in range(count):
            log = log_dir / f"gate{i}.log"
            gate = ServedGate(
                model, options, token=token, log=log, env={**SERVED_ENV, **(env or {})}
            )
            started.append(gate)
        for gate in started:
            gate.wait_healthy(token, timeout_s)
        yield started
    finally:
        for gate in started:
            gate.stop()


class FleetEndpoint:
    """The gates of a `GateFleet` as one `GateEndpoint`: open a rollout through the fleet
    first; its URL is then on the gate that owns it."""

    def __init__(self, fleet: GateFleet, model: str, urls: Sequence[str]) -> None:
        self.fleet = fleet
        self._model = model
        self._urls = list(urls)

    @property
    def model(self) -> str:
        """The served model's name (every gate serves the same)."""
        return self._model

    @property
    def base_url(self) -> str:
        """The first gate's URL."""
        return self._urls[0]

    def rollout_url(self, rollout_id: str) -> str:
        """The OpenAI base URL of an opened rollout, on its gate."""
        return self.fleet.base_url(rollout_id)


async def _close_if_open(gate: ControlPlaneClient, rollout_id: str) -> None:
    """Close ``rollout_id``; one closed or forgotten meanwhile is settled (its release
    follows); ``rollout_owned`` is raised."""
    try:
        await gate.close(rollout_id)
    except ControlConflict as e:
        if e.code == "rollout_owned":
            raise
    except ControlNotFound:
        pass


async def reclaim_rollouts(
    urls: Sequence[str], token: str, sink: TQSink, *, owner: str | None = None
) -> dict[str, int]:
    """What a restarted trainer does first: every rollout the gates at ``urls`` still hold
    (left by a trainer that died: open, or closed and never released) is closed if open
    and released, and the rows it staged in ``sink`` are cleared; nothing is held forever.

    Asked as ``owner`` (the new trainer's fleet owner): rollouts of another owner that is
    still active are left alone (the gate answers ``rollout_owned``), so a second trainer
    never takes a live one's rollouts or rows; an owner silent past the gates' lease
    (``--tokcap-owner-lease-s``) is taken from. Returns ``{url: rollouts reclaimed}``. The
    dead trainer's rewards are gone, so none of these rollouts trains.
    """
    reclaimed: dict[str, int] = {}
    ids: set[str] = set()
    for url in urls:
        taken = 0
        async with ControlPlaneClient(url, token, owner=owner) as gate:
            for item in await gate.rollouts():
                try:
                    if item.state == "open":
                        await _close_if_open(gate, item.rollout_id)
                    await gate.release(item.rollout_id)
                except ControlConflict as e:
                    if e.code == "rollout_owned":
                        continue  # a live trainer's: not ours to take
                    raise
                except ControlNotFound:
                    pass  # released meanwhile: settled
                ids.add(item.rollout_id)
                taken += 1
        reclaimed[url.rstrip("/")] = taken
    stale = [k for k in await sink.staged_keys() if k.split("/", 1)[0] in ids]
    if stale:
        await sink.clear(stale)
    return reclaimed
