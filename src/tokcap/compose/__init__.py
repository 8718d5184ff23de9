"""Composing tokcap: the trainer's side (`collect`, `finish`) and the stack it runs on.

A trainer that has let a harness play its rollouts through a gate calls `collect` (close
with reward + witness, verified receipts, the Ray pool with the receipts' rewards, the
group policy, advantages for accepted groups) and, after its optimizer step, `finish`
(free the rows, release the rollouts). Both report per-stage timings; decisions are typed
(`tokcap_core.Accept`, `Replace`, `Drop`).

`play_rollouts` lets a harness play rollouts through a gate, a bounded number at a time.

A run's stack (after `tokcap.prepare_environment` at start-up): `place` starts the
services (Ray, TransferQueue: `services`) and the gates of a `Placement` (one in this
process, `in_process_gate`, or a fleet of served gates) and yields a `Site`; on the run's
event loop `Site.open` (`open_stack`: the pool and the control plane, and the weight
sync) yields a `Run`: its `Stack`, its fleet and `Run.push`. `tokcap demo`, `tokcap train`
and ``examples/custom_trainer.py`` (the worked example) all run this way; `services`,
`tq_sink` and `open_stack` are the parts, for a trainer that builds its own.

Gates as their own processes: `served_gates` starts N ``tokcap-vllm serve`` gates with
`served_gate_options` (TransferQueue on the run's Ray, weight pushes from the trainer);
`FleetEndpoint` plays rollouts on a `tokcap_vllm.GateFleet` over them. `fleet_gates`
starts a run's gates (or takes running ones), `push_to_live_gates` pushes weights to the
gates that still answer, `gate_entries` reports each gate; a gate lost mid-step poisons
only its own rollouts (`play_rollouts` lets them go, `finish` clears what they staged).
"""

from . import _fleet, _harness, _run, _served, _stack, _trainer
from ._fleet import *  # noqa: F403
from ._harness import *  # noqa: F403
from ._run import *  # noqa: F403
from ._served import *  # noqa: F403
from ._stack import *  # noqa: F403
from ._trainer import *  # noqa: F403

__all__ = [
    *_fleet.__all__,
    *_harness.__all__,
    *_run.__all__,
    *_served.__all__,
    *_stack.__all__,
    *_trainer.__all__,
]
