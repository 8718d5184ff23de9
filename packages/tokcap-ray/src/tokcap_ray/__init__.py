"""tokcap adapter for Ray: a pool of actors that reassemble groups into training rows.

A controller sends metadata-only `tokcap_core.ReassemblyRequest`s; each
``RolloutReassemblerActor`` fetches the group's staged rows from its sink in one
batch, verifies and reassembles them with the core, publishes exactly one row per
segment (a ``sample_mask=0`` placeholder per invalid rollout) to the training
partition, clears staging and returns a `tokcap_core.FinalizedGroup`. Idempotent by
group id; dead actors are replaced and their requests retried; an outcome that cannot
be known is reported as ``outcome="unknown"``. The controller, not the pool, decides
what to do with a group (`tokcap_core.decide_group`).
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('tokcap_ray needs Ray: pip install "tokcap-ray" (or "ray==2.60.*")') from e

from ._actor import TIMING_KEYS, RolloutReassemblerActor, SinkFactory
from ._config import PoolConfig
from ._errors import PoolError
from ._metrics import step_metrics
from ._pool import ReassemblerPool
from ._progress import GroupRecord, ProgressActor, RecordState
from ._sink_actor import ActorSink, SinkActor

__all__ = [
    "TIMING_KEYS",
    "ActorSink",
    "GroupRecord",
    "PoolConfig",
    "PoolError",
    "ProgressActor",
    "ReassemblerPool",
    "RecordState",
    "RolloutReassemblerActor",
    "SinkActor",
    "SinkFactory",
    "step_metrics",
]
