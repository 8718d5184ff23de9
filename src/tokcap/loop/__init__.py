"""The ``tokcap train`` room: a closed GRPO loop through the whole product, step by step.

Not to be confused with `tokcap.train` (the torch trainer this loop drives): this room
holds the task the harness plays, the step (generate, capture + verify, reassemble, train,
push), its summary and report. The command itself is ``tokcap train``.
"""

from ._loop import LoopConfig, StepRecord, TrainRun, load_policy, run_loop
from ._report import render_train_report
from ._summary import build_train_summary, print_train_summary, train_problems
from ._task import SYSTEM

__all__ = [
    "SYSTEM",
    "LoopConfig",
    "StepRecord",
    "TrainRun",
    "build_train_summary",
    "load_policy",
    "print_train_summary",
    "render_train_report",
    "run_loop",
    "train_problems",
]
