"""The ``tokcap train`` room: a closed GRPO loop through the whole product, step by step.

Not to be confused with `tokcap.train` (the torch trainer this loop drives): this room
holds the loop itself (`run_loop`, which runs `train`: one function, each step generate,
capture + verify, reassemble, train, push), the task its harness plays, the lock-step and
asynchronous feeds of its steps, its summary and report. The command: `run_train` (what ``tokcap
train`` runs, from `tokcap.__main__`).
"""

from ._cli import run_train
from ._config import MODEL_FAMILIES, LoopConfig, ModelFamily
from ._loop import run_loop, train
from ._meters import BusyMeter, CpuMeter
from ._policy import load_policy
from ._report import render_train_report
from ._staleness import STALE, LoopError, Provenance, SkipCount, StalenessPolicy, provenance
from ._step import StepRecord, TrainRun
from ._summary import build_train_summary, print_train_summary, tokcap_share, train_problems
from ._sync import StepTail
from ._task import (
    HARNESS_APIS,
    MORE,
    SYSTEM,
    TASKS,
    DigitsEpisode,
    HarnessApi,
    group_image,
    long_tail_shape,
    tool_response,
)
from ._watchdog import LagWatch, Stall

__all__ = [
    "HARNESS_APIS",
    "MODEL_FAMILIES",
    "MORE",
    "STALE",
    "SYSTEM",
    "TASKS",
    "BusyMeter",
    "CpuMeter",
    "DigitsEpisode",
    "HarnessApi",
    "LagWatch",
    "LoopConfig",
    "LoopError",
    "ModelFamily",
    "Provenance",
    "SkipCount",
    "StalenessPolicy",
    "Stall",
    "StepRecord",
    "StepTail",
    "TrainRun",
    "build_train_summary",
    "group_image",
    "load_policy",
    "long_tail_shape",
    "print_train_summary",
    "provenance",
    "render_train_report",
    "run_loop",
    "run_train",
    "tokcap_share",
    "tool_response",
    "train",
    "train_problems",
]
