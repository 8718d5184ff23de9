"""Harness bits the benchmark scripts share: the CPU engine's environment and count options.

Scripts run as ``python bench/<name>.py``, so ``bench/`` is on ``sys.path`` and they import
this module by its bare name. Call `set_engine_env` before anything imports vLLM or Ray.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Sequence

__all__ = ["CPU_ENGINE_ARGS", "ENGINE_ENV", "parse_counts", "set_engine_env", "stop_all"]

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""What a tiny-model vLLM engine needs on this CPU machine (ENVIRONMENT.md)."""


CPU_ENGINE_ARGS = ("--enforce-eager", "--distributed-executor-backend", "uni", "--dtype", "float32")
"""vLLM options every benchmark's CPU engine starts with (eager, one process, fp32)."""


def set_engine_env(**extra: str) -> None:
    """Default `ENGINE_ENV` and ``extra`` into ``os.environ`` (a value already set wins)."""
    for name, value in {**ENGINE_ENV, **extra}.items():
        os.environ.setdefault(name, value)


def parse_counts(
    doc: str | None, argv: Sequence[str] | None = None, **defaults: int
) -> argparse.Namespace:
    """Parse one ``--name N`` option per keyword (``_`` spelled ``-``), each an int."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return parser.parse_args(argv)


def stop_all(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float = 60) -> None:
    """SIGTERM every process, then wait for each (they shut down together, not in turn)."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout_s)
