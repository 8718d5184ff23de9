"""The ``tokcap train`` room: a closed GRPO loop through the whole product, step by step.

Not to be confused with `tokcap.train` (the torch trainer this loop drives): this room
holds the task the harness plays, the step (generate, capture + verify, reassemble, train,
push), its summary and report. The command itself is ``tokcap train``.
"""

from ._loop import LoopConfig, StepRecord, TrainRun, load_policy, run_loop
from ._task import SYSTEM

__all__ = ["SYSTEM", "LoopConfig", "StepRecord", "TrainRun", "load_policy", "run_loop"]
