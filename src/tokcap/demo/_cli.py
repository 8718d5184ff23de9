"""``tokcap demo``: build the tiny model, run the pipeline, check the rows, save and print.

Environment defaults for the CPU engine are set here, before vLLM is imported: vLLM's
fast-start mode and Ray's "do not re-run ``uv run`` in workers".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

for _name, _value in {
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
}.items():
    os.environ.setdefault(_name, _value)


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


quiet_third_parties()

from rich.console import Console  # noqa: E402

__all__ = ["DemoOptions", "run_demo"]

QUICK = {"groups": 2, "rollouts": 4, "turns": 3, "max_tokens": 16}
FULL = {"groups": 4, "rollouts": 6, "turns": 4, "max_tokens": 24}


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """The ``tokcap demo`` flags (None: the quick or full default)."""

    groups: int | None = None
    rollouts: int | None = None
    turns: int | None = None
    max_tokens: int | None = None
    segments: str = "terminal"
    out: Path | None = None
    quick: bool = False
    seed: int = 0
    cache: Path = Path(".tokcap")
    ray_address: str | None = None
    model_family: str = "qwen"


def _interrupt_once(signum: int, frame: Any) -> None:
    """First Ctrl-C interrupts; later ones are ignored so the shutdown can finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_demo(options: DemoOptions, console: Console | None = None) -> int:
    """Run the demo; 0 when every check holds, 1 when one fails, 130 on Ctrl-C."""
    from ._summary import summary_console

    console = console or summary_console()
    err = Console(stderr=True)
    defaults = QUICK if options.quick else FULL
    pick = {k: getattr(options, k) or v for k, v in defaults.items()}
    out = options.out or options.cache / "runs" / time.strftime("%Y%m%d-%H%M%S")
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        return _run(options, pick, out, console, err)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted: everything the demo started has been shut down")
        return 130


def _run(
    options: DemoOptions, pick: dict[str, int], out: Path, console: Console, err: Console
) -> int:
    from .._stages import Stages

    with Stages(err) as stages:
        with stages.stage(f"build tiny {options.model_family} model (cached)"):
            from ._families import model_family

            family = model_family(options.model_family, options.cache)
            from ._pipeline import DemoConfig, run_pipeline

        config = DemoConfig(
            model=family.model,
            groups=pick["groups"],
            rollouts=pick["rollouts"],
            turns=pick["turns"],
            max_tokens=pick["max_tokens"],
            segments=options.segments,
            seed=options.seed,
            ray_address=options.ray_address,
            family=family.name,
        )
        run = run_pipeline(
            config,
            stages,
            vllm_args=family.vllm_args,
            force_tools=family.force_tools,
            tools_every_turn=family.tools_every_turn,
        )
        with stages.stage("checks, summary, report"):
            from ._checks import check_rows
            from ._report import render_report
            from ._summary import build_summary

            tokenizer = family.load_tokenizer()
            episodes = {e.rollout_id: e for e in run.episodes}
            parity, drift = check_rows(
                run.rows, episodes, run.manifests, tokenizer, family.retokenize
            )
            summary = build_summary(run, parity, drift, stages.timings_s)
            samples = _samples(run, drift)
            out.mkdir(parents=True, exist_ok=True)
            page = render_report(summary, samples, tokenizer)
            (out / "report.html").write_text(page, encoding="utf-8")
    summary["timings_s"] = {k: round(v, 3) for k, v in stages.timings_s.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    from ._summary import print_summary

    print_summary(summary, console)
    problems = summary_problems(summary)
    for problem in problems:
        console.print(f"[red]check failed: {problem}")
    console.print(f"saved [bold]{out / 'summary.json'}[/] and [bold]{out / 'report.html'}[/]")
    return 1 if problems else 0


def summary_problems(summary: dict[str, Any]) -> list[str]:
    """The demo's invariants, as messages for each one that does not hold."""
    rows, par = summary["rows"], summary["engine_parity"]
    problems = []
    if rows["valid"] + rows["placeholder"] != rows["total"]:
        problems.append("valid + placeholder rows != total rows")
    if rows["verified"] != rows["valid"]:
        problems.append("a valid row does not match its receipt chain")
    if par["rows_differing"]:
        problems.append(f"{par['rows_differing']} rows differ from the engine's own ids")
    if summary["advantages"]["placeholder_rows_nonzero"]:
        problems.append("a placeholder row got a non-zero advantage")
    return problems


def _samples(run: Any, drift: list[Any]) -> list[Any]:
    """Every valid row for the report, by group then rollout; drifted rows carry their drift."""
    drift_of = {d.rollout_id: d for d in drift}
    group_of = {e.rollout_id: e.group for e in run.episodes}
    rows = sorted(
        (r for r in run.rows if r.sample_mask),
        key=lambda r: (group_of.get(r.rollout_id, 0), r.rollout_id, r.segment),
    )
    return [
        (
            row,
            run.receipts[row.rollout_id],
            drift_of.get(row.rollout_id) if row.segment == 0 else None,
        )
        for row in rows
    ]
