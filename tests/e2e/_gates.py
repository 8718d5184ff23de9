"""Start real ``tokcap-vllm serve`` processes for the e2e tests (the CLI a user runs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

VLLM_ARGS = [
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
    "--max-model-len",
    "1024",
    "--dtype",
    "float32",
    "--disable-log-stats",
    "--max-num-seqs",
    "16",
]
"""vLLM's own options for a served test gate (the CPU engine, fast start)."""

ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServedGate:
    """One ``tokcap-vllm serve`` OS process; its output goes to ``log``."""

    def __init__(
        self, model: Path, options: Sequence[str], *, token: str, log: Path, port: int = 0
    ) -> None:
        self.port = port or free_port()
        self.log = log
        env = {**os.environ, **ENGINE_ENV, "TOKCAP_CONTROL_TOKEN": token}
        command = [
            str(Path(sys.executable).with_name("tokcap-vllm")),
            "serve",
            str(model),
            *options,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *VLLM_ARGS,
        ]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, token: str, timeout_s: float = 600.0) -> None:
        """Wait until ``/tokcap/v1/health`` answers 200 (raise with the log if it died)."""
        deadline = time.monotonic() + timeout_s
        headers = {"authorization": f"Bearer {token}"}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
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
