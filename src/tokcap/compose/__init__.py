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
example; `tokcap demo` and `tokcap train` are built on this module: `run_in_process` (one
gate in this process) and `run_on_fleet` (served gates) start a run's whole stack for a
`Placement` and run its body on it.

Gates as their own processes: `served_gates` starts N ``tokcap-vllm serve`` gates with
`served_gate_options` (TransferQueue on the run's Ray, weight pushes from the trainer);
`FleetEndpoint` plays rollouts on a `tokcap_vllm.GateFleet` over them. `fleet_gates`
starts a run's gates (or takes running ones), `push_to_live_gates` pushes weights to the
gates that still answer, `gate_entries` reports each gate; a gate lost mid-step poisons
only its own rollouts (`play_rollouts` lets them go, `finish` clears what they staged).
"""

from . import _fleet, _harness, _served, _stack, _trainer
from ._fleet import *  # noqa: F403
from ._harness import *  # noqa: F403
from ._served import *  # noqa: F403
from ._stack import *  # noqa: F403
from ._trainer import *  # noqa: F403

__all__ = [*_fleet.__all__, *_harness.__all__, *_served.__all__, *_stack.__all__, *_trainer.__all__]
