"""Start-up of a process that runs the engine in-process, and of ``tokcap demo`` / ``train``.

Nothing here imports vLLM, torch, Ray or TransferQueue: `prepare_environment` must run
before they are imported (`tokcap.prepare_environment` is its public door). `start_up` is
the one explicit call that prepares the process (the CPU engine's
environment defaults, quiet third-party loggers); `interruptible` runs a command so that
the first Ctrl-C interrupts it and later ones let its shutdown finish. `RunOptions` are
``tokcap demo``'s run flags (``tokcap train``'s are `tokcap.loop.LoopConfig`'s; both save
their runs under `RunOptions.run_dir`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENVIRONMENT_DEFAULTS",
    "RunOptions",
    "interruptible",
    "prepare_environment",
    "quiet_third_parties",
    "save_and_print",
    "start_up",
    "use_driver_threads",
]

ENVIRONMENT_DEFAULTS: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "TQ_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
    # torch's C++ notes (NUMA binding, ...) go straight to stderr unless silenced here
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # torch's Python loggers ("Triton not available", fx tracing notes): torch sets their
    # level itself at import, in this process and in every child, from this variable
    "TORCH_LOGS": "-all",
    # the multiprocessing resource tracker (a child process) warns about semaphores that
    # vLLM's engine leaves for it to clean up at exit: nothing the user can act on; and
    # FutureWarnings raised at import in child processes (vLLM's, torch's deprecations)
    "PYTHONWARNINGS": "ignore::UserWarning:multiprocessing.resource_tracker,ignore::FutureWarning",
}
"""What `prepare_environment` sets where unset: vLLM's fast-start CPU mode, Ray's "do not
re-run ``uv run`` in workers", and quiet third-party loggers in this process and children."""


_driver_threads: int | None = None
"""This process's own torch threads, where `prepare_environment` chose the children's."""


def prepare_environment() -> None:
    """Set `ENVIRONMENT_DEFAULTS` where unset, and, where ``OMP_NUM_THREADS`` is unset, give
    the processes this one starts (vLLM's engine core above all) one core fewer than this
    process may use, at least one: call once at start-up, before vLLM or torch is imported.

    The engine's OpenMP threads then leave a core to this process (the API server, the
    gate, the harness, the pumps), which works while the engine generates: on a 2-core box
    an engine on both cores made ``tokcap train`` 15 % slower lock-step and 29 % slower
    ``--async`` on the long-tailed task (`bench/bench_async.py`), the two fighting over
    the cores. This process's own torch (the trainer) keeps every core:
    `use_driver_threads`.
    """
    global _driver_threads
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores - 1))
        _driver_threads = cores


def use_driver_threads() -> None:
    """Give this process's torch every core it may use again, where `prepare_environment`
    set ``OMP_NUM_THREADS`` for the children (a user's own ``OMP_NUM_THREADS`` is kept)."""
    if _driver_threads is not None:
        import torch

        torch.set_num_threads(_driver_threads)


def quiet_third_parties() -> None:
    """Keep the screen for tokcap's progress: third-party warnings and notes go nowhere.

    torch/vLLM/transformers ``FutureWarning``s and deprecations at import, "Triton not
    available" notes and the like say nothing a demo user can act on; tokcap's own warnings
    and every error still show.
    """
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings(
            "ignore", category=category, module=r"(torch|vllm|transformers|ray|transfer_queue)"
        )
    for name in ("torch", "vllm", "ray", "transfer_queue", "transformers", "httpx", "uvicorn"):
        logging.getLogger(name).setLevel(logging.ERROR)


def start_up() -> None:
    """Prepare this process for a run: `prepare_environment`, then `quiet_third_parties`."""
    prepare_environment()
    quiet_third_parties()


def interruptible(body: Callable[[], int], what: str) -> int:
    """``body()``'s status, or 130 after a Ctrl-C (saying that everything ``what`` started
    has been shut down)."""
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        return body()
    except KeyboardInterrupt:
        from rich.console import Console

        Console(stderr=True).print(
            f"[yellow]interrupted: everything {what} started has been shut down"
        )
        return 130


def _interrupt_once(signum: int, frame: Any) -> None:
    """First Ctrl-C interrupts; later ones are ignored so the shutdown can finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def save_and_print(
    summary: dict[str, Any],
    out: Path,
    timings_s: Mapping[str, float],
    console: Any,
    show: Callable[[dict[str, Any], Any], None],
    problems: list[str],
) -> int:
    """Write ``summary`` (with the stages' timings) to ``out/summary.json``, ``show`` it on
    ``console``, name each of ``problems``; 1 when there is one, else 0."""
    summary["timings_s"] = {k: round(v, 3) for k, v in timings_s.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    show(summary, console)
    for problem in problems:
        console.print(f"[red]check failed: {problem}")
    console.print(f"saved [bold]{out / 'summary.json'}[/] and [bold]{out / 'report.html'}[/]")
    return 1 if problems else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """``tokcap demo``'s run flags: the seed, where the run is saved (``tokcap train``'s
    default too), and where its services and gates run."""

    seed: int = 0
    out: Path | None = None
    cache: Path = Path(".tokcap")
    ray_address: str | None = None
    gates: int = 0
    gate_urls: tuple[str, ...] | list[str] = ()

    def run_dir(self, prefix: str = "") -> Path:
        """``out``, else a folder under ``cache/runs`` named ``prefix`` and the time."""
        return self.out or self.cache / "runs" / time.strftime(f"{prefix}%Y%m%d-%H%M%S")

    def placement(self) -> dict[str, Any]:
        """These flags as the run config's keywords (``seed`` and where it runs)."""
        return {
            "seed": self.seed,
            "ray_address": self.ray_address,
            "gates": self.gates,
            "gate_urls": tuple(self.gate_urls),
        }
