"""The weight transfer: how a trainer's weights get into a running engine, and what it serves.

- what weights the engine serves, as a pure state machine (`WeightState`, `WeightPhase`;
  ``_weight_state``: versions, labels);
- a push file (``_shm``): every tensor's bytes back to back in one file, described by JSON
  entries, checked before a worker reads it; the tensors a push must carry (`TensorSpec`,
  ``_spec``, read from the checkpoint the engine loaded);
- the push from inside the server's own process (`WeightSync`, ``_weights``: modes, checks)
  and its vLLM worker extension (`WeightSyncWorker`, ``_worker``);
- tokcap's CPU transport as a vLLM weight-transfer engine, backend ``tokcap_shm``
  (``_engine``; registered by the ``vllm.general_plugins`` entry point, chosen with
  ``--weight-transfer-config '{"backend": "tokcap_shm"}'``): the worker side
  (`TokcapShmWeightTransferEngine`), which loads a CPU engine's weights straight from the
  push file where it can (``_direct_load``, planned by ``_direct_plan``), and the trainer
  side (`TokcapShmTrainerWeightTransferEngine`) for trainer code written against vLLM's
  ``WeightTransferTrainerFactory``::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    engine = WeightTransferTrainerFactory.trainer_init(
        TokcapShmTrainerInitInfo(rank=0),
        client=BearerWeightSyncClient(url, token),
        source=StateDictSource(model.state_dict()),
    )
    engine.send_weights()  # start, update, finish; pausing and the prefix-cache reset are
                           # yours (tokcap_vllm.weights.GateWeightClient does all of it)

The ``tokcap_shm`` engine classes import vLLM and torch, so they are loaded on first use;
the rest imports without either. The trainer's clients for served gates are in
`tokcap_vllm.client`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._shm import PUSH_PREFIX, SHM_DIR, Entry, PushFile, check_push_file, entries_for, file_chunks
from ._spec import TensorSpec, engine_spec, expected_spec, read_checkpoint_spec
from ._weight_state import WeightPhase, WeightState, check_version, next_version, version_of_label
from ._weights import (
    PUSH_MODES,
    PauseMode,
    PushMode,
    WeightSync,
    check_push,
    refuse_non_finite,
    resets_running_kv,
    vllm_pause_mode,
)
from ._worker import WeightSyncWorker

if TYPE_CHECKING:
    from ._engine import (
        BACKEND,
        BearerWeightSyncClient,
        StateDictSource,
        TokcapShmInitInfo,
        TokcapShmTrainerInitInfo,
        TokcapShmTrainerWeightTransferEngine,
        TokcapShmUpdateInfo,
        TokcapShmWeightTransferEngine,
    )

__all__ = [
    "BACKEND",
    "PUSH_MODES",
    "PUSH_PREFIX",
    "SHM_DIR",
    "BearerWeightSyncClient",
    "Entry",
    "PauseMode",
    "PushFile",
    "PushMode",
    "StateDictSource",
    "TensorSpec",
    "TokcapShmInitInfo",
    "TokcapShmTrainerInitInfo",
    "TokcapShmTrainerWeightTransferEngine",
    "TokcapShmUpdateInfo",
    "TokcapShmWeightTransferEngine",
    "WeightPhase",
    "WeightState",
    "WeightSync",
    "WeightSyncWorker",
    "check_push",
    "check_push_file",
    "check_version",
    "engine_spec",
    "entries_for",
    "expected_spec",
    "file_chunks",
    "next_version",
    "read_checkpoint_spec",
    "refuse_non_finite",
    "resets_running_kv",
    "version_of_label",
    "vllm_pause_mode",
]


def __getattr__(name: str) -> Any:
    # The names of __all__ not imported above are _engine's (it imports vLLM and torch).
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _engine

    value = getattr(_engine, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
