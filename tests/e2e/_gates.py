"""Start real ``tokcap-vllm serve`` processes for the e2e tests (the CLI a user runs).

`ServedGate` is `tokcap.compose.ServedGate` with the tests' fast-start engine options.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokcap.compose import SERVED_ENV, free_port
from tokcap.compose import ServedGate as _ServedGate

__all__ = ["ENGINE_ENV", "VLLM_ARGS", "ServedGate", "free_port"]

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


class ServedGate(_ServedGate):
    """One ``tokcap-vllm serve`` OS process with the tests' engine options (``vllm_args``,
    `VLLM_ARGS` unless given; and the environment every served gate of a run gets: vLLM's
    RL routes, its own engine core)."""

    def __init__(
        self,
        model: Path,
        options: Sequence[str],
        *,
        token: str,
        log: Path,
        port: int = 0,
        vllm_args: Sequence[str] = tuple(VLLM_ARGS),
    ) -> None:
        super().__init__(
            model,
            [*options, *vllm_args],
            token=token,
            log=log,
            port=port,
            env={**SERVED_ENV, **ENGINE_ENV},
        )
