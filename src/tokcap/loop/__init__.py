"""The ``tokcap train`` room: a closed GRPO loop through the whole product, step by step.

Not to be confused with `tokcap.train` (the torch trainer this loop drives): this room
holds the loop itself (`run_loop`, which runs `train`: one function, each step generate,
capture + verify, reassemble, train, push), the task its harness plays, the lock-step and
asynchronous feeds of its steps, its summary and report. The command: `run_train` (what ``tokcap
train`` runs, from `tokcap.__main__`).

Its names load on first use (PEP 562): ``tokcap show`` and a refused ``tokcap train`` option
need the summary and the config, not the loop's Ray, TransferQueue and torch (about 9 s of
imports).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cli import loop_config, run_train
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

_HOME = {
    "BusyMeter": "._meters",
    "CpuMeter": "._meters",
    "DigitsEpisode": "._task",
    "HARNESS_APIS": "._task",
    "HarnessApi": "._task",
    "LagWatch": "._watchdog",
    "LoopConfig": "._config",
    "MODEL_FAMILIES": "._config",
    "ModelFamily": "._config",
    "LoopError": "._staleness",
    "MORE": "._task",
    "Provenance": "._staleness",
    "STALE": "._staleness",
    "SYSTEM": "._task",
    "SkipCount": "._staleness",
    "StalenessPolicy": "._staleness",
    "Stall": "._watchdog",
    "StepRecord": "._step",
    "StepTail": "._sync",
    "TASKS": "._task",
    "TrainRun": "._step",
    "build_train_summary": "._summary",
    "group_image": "._task",
    "load_policy": "._policy",
    "long_tail_shape": "._task",
    "loop_config": "._cli",
    "print_train_summary": "._summary",
    "provenance": "._staleness",
    "render_train_report": "._report",
    "run_loop": "._loop",
    "run_train": "._cli",
    "tokcap_share": "._summary",
    "tool_response": "._task",
    "train": "._loop",
    "train_problems": "._summary",
}

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
    "loop_config",
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


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later reads skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
