"""``tokcap train``: build the tiny model, run the closed loop, save and print the figures.

The process is prepared by `tokcap._startup.start_up` before this module is imported
(``tokcap train`` calls it first: the CPU engine's environment defaults, quiet loggers).
Its flags are `LoopConfig`'s fields (`loop_config`) and ``--out``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from tokcap_core import ConfigError

from .._startup import RunOptions, interruptible, save_and_print, use_driver_threads
from ._config import LoopConfig
from ._summary import (
    build_train_summary,
    print_train_summary,
    summary_console,
    train_problems,
)

__all__ = ["TINY_MODEL", "loop_config", "run_train"]

TINY_MODEL = RunOptions().cache / "tiny" / "dense"
"""Where ``tokcap train`` builds (once, then reuses) the tiny model it trains."""
TINY_VLM = RunOptions().cache / "tiny" / "vlm"
"""Where ``tokcap train --model-family idefics3`` builds its tiny vision-language model."""


def loop_config(flags: Mapping[str, Any]) -> LoopConfig:
    """The loop's config from ``tokcap train``'s ``flags`` (those naming a `LoopConfig`
    field): the family's tiny model, ``turns`` (None) 2 for the agent task and 1 for the
    others.
    Raises `ConfigError` for a bad value (`LoopConfig`)."""
    names = {field.name for field in dataclasses.fields(LoopConfig)}
    given = {name: value for name, value in flags.items() if name in names}
    turns = given.get("turns") or (2 if given.get("task", "agent") == "agent" else 1)
    gate_urls = tuple(given.get("gate_urls", ()))
    model = TINY_VLM if given.get("model_family") == "idefics3" else TINY_MODEL
    return LoopConfig(**{**given, "model": model, "turns": turns, "gate_urls": gate_urls})


def run_train(flags: Mapping[str, Any], console: Console | None = None) -> int:
    """Run the loop of ``flags`` (`loop_config`; ``out``: the run folder, default
    ``.tokcap/runs/train-<time>``); 0 when every invariant held, 1 when one failed, 2 for a
    bad option, 130 on Ctrl-C."""
    console = console or summary_console()
    out = flags.get("out") or RunOptions().run_dir("train-")
    return interruptible(lambda: _checked(flags, out, console), "the loop")


def _checked(flags: Mapping[str, Any], out: Path, console: Console) -> int:
    """`_run`; 2 for a bad option."""
    try:
        return _run(loop_config(flags), out, console)
    except ConfigError as e:
        # one line, escaped (rich would take the error's ``[code]`` for markup and drop it)
        Console(stderr=True).print(
            f"[red]tokcap train: {escape(str(e))}", highlight=False, soft_wrap=True
        )
        return 2


def _run(config: LoopConfig, out: Path, console: Console) -> int:
    from .._stages import Stages

    use_driver_threads()  # the trainer on every core; the engine core one fewer

    with Stages(Console(stderr=True)) as stages:
        with stages.stage(f"build tiny {config.model_family} model (cached)"):
            from ..tiny import build_tiny_model, build_tiny_vlm

            if config.images:
                model = build_tiny_vlm(config.model)
            else:
                model = build_tiny_model(config.model, kind="dense")
            from ._loop import run_loop
            from ._step import StepRecord

        def progress(record: StepRecord) -> None:
            stages.log(
                f"step {record.step:>3}  reward {record.reward_mean:.3f}  "
                f"K3 {record.parity['k3']:.1e}  stale<={record.staleness_max}  "
                f"pushed v{record.weight_version}  "
                f"{record.seconds['total']:.1f} s"
            )

        run = run_loop(dataclasses.replace(config, model=model), stages, progress)
        with stages.stage("summary, report"):
            from ._report import render_train_report

            summary = build_train_summary(run, stages.timings_s)
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.html").write_text(render_train_report(summary), encoding="utf-8")
    problems = train_problems(summary)
    return save_and_print(summary, out, stages.timings_s, console, print_train_summary, problems)
