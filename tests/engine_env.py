"""The environment an in-process vLLM CPU engine of the tests starts in (fast-start mode:
one process, no thread binding, a small KV cache, quiet logs), set before vLLM is imported.

For ``tests/vllm/conftest.py``'s session engine, the other test files that start their own
in-process engine, and ``bench/walk_rollout.py``, which starts its engine as that conftest
does. A served gate (its own OS process) gets ``tests.e2e._gates.ENGINE_ENV`` instead.
"""

from __future__ import annotations

import os

__all__ = ["CPU_ENGINE_ENV", "set_cpu_engine_env"]

CPU_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
}
"""What `set_cpu_engine_env` sets where unset."""


def set_cpu_engine_env() -> None:
    """Set `CPU_ENGINE_ENV` where unset (call before vLLM is imported)."""
    for name, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(name, value)
