"""``tokcap train``: build the tiny model, run the closed loop, save and print the figures.

The process is prepared by `tokcap._startup.start_up` before this module is imported
(``tokcap train`` calls it first: the CPU engine's environment defaults, quiet loggers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rich.console import Console

from tokcap_core import ConfigError

from .._startup import RunOptions, interruptible, save_and_print
from ._summary import (
    build_train_summary,
    print_train_summary,
    summary_console,
    train_problems,
)

__all__ = ["TrainOptions", "run_train"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions(RunOptions):
    """The ``tokcap train`` flags."""

    steps: int = 40
    groups: int = 4
    rollouts: int = 8
    turns: int | None = None
    """None: 2 for the agent task, 1 for digits."""
    task: Literal["agent", "digits", "long-tail"] = "agent"
    harness_api: Literal["chat", "responses", "messages"] = "chat"
    max_tokens: int = 16
    lr: float = 1e-2
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 2
    importance: bool | None = None


def run_train(options: TrainOptions, console: Console | None = None) -> int:
    """Run the loop; 0 when every invariant held, 1 when one failed, 2 for a bad option,
    130 on Ctrl-C."""
    console = console or summary_console()
    out = options.run_dir("train-")
    return interruptible(lambda: _checked(options, out, console), "the loop")


def _checked(options: TrainOptions, out: Path, console: Console) -> int:
    """`_run`; 2 for a bad option."""
    try:
        return _run(options, out, console)
    except ConfigError as e:
        Console(stderr=True).print(f"[red]tokcap train: {e}", highlight=False)
        return 2


def _run(options: TrainOptions, out: Path, console: Console) -> int:
    from .._stages import Stages

    with Stages(Console(stderr=True)) as stages:
        with stages.stage("build tiny model (cached)"):
            from ..tiny import build_tiny_model

            model = build_tiny_model(options.cache / "tiny" / "dense", kind="dense")
            from ._loop import LoopConfig, StepRecord, run_loop

        config = LoopConfig(
            model=model,
            steps=options.steps,
            groups=options.groups,
            rollouts=options.rollouts,
            turns=options.turns or (2 if options.task == "agent" else 1),
            task=options.task,
            harness_api=options.harness_api,
            max_tokens=options.max_tokens,
            lr=options.lr,
            mode=options.mode,
            max_staleness=options.max_staleness,
            importance=options.importance,
            **options.placement(),
        )

        def progress(record: StepRecord) -> None:
            stages.log(
                f"step {record.step:>3}  reward {record.reward_mean:.3f}  "
                f"K3 {record.parity['k3']:.1e}  stale<={record.staleness_max}  "
                f"pushed v{record.weight_version}  "
                f"{record.seconds['total']:.1f} s"
            )

        run = run_loop(config, stages, progress)
        with stages.stage("summary, report"):
            from ._report import render_train_report

            summary = build_train_summary(run, stages.timings_s)
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.html").write_text(render_train_report(summary), encoding="utf-8")
    problems = train_problems(summary)
    return save_and_print(summary, out, stages.timings_s, console, print_train_summary, problems)
