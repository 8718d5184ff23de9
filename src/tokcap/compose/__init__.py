"""Composing tokcap: the trainer's side (`collect`, `finish`) and the stack it runs on.

A trainer that has let a harness play its rollouts through a gate calls `collect` (close
with reward + witness, verified receipts, the Ray pool with the receipts' rewards, the
group policy, advantages for accepted groups) and, after its optimizer step, `finish`
(free the rows, release the rollouts). Both report per-stage timings; decisions are typed
(`tokcap_core.Accept`, `Replace`, `Drop`).

`play_rollouts` lets a harness play rollouts through a gate, a bounded number at a time.

The stack (after `tokcap.prepare_environment` at start-up): `tq_sink`, `in_process_gate`
and `services` (Ray, TransferQueue, the gate's engine), then `open_stack` (the pool and
the control plane) yields a `Stack`. ``examples/custom_trainer.py`` is the worked
example; `tokcap demo` and `tokcap train` are built on this module.
"""

from ._harness import Rollout, play_rollouts
from ._stack import (
    GateEndpoint,
    Stack,
    StageHook,
    in_process_gate,
    open_stack,
    services,
    tq_sink,
)
from ._trainer import (
    Batch,
    CollectTimings,
    ControlPlane,
    Finished,
    FinishTimings,
    collect,
    finish,
)

__all__ = [
    "Batch",
    "CollectTimings",
    "ControlPlane",
    "FinishTimings",
    "Finished",
    "GateEndpoint",
    "Rollout",
    "Stack",
    "StageHook",
    "collect",
    "finish",
    "in_process_gate",
    "open_stack",
    "play_rollouts",
    "services",
    "tq_sink",
]
