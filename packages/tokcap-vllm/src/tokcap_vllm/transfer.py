"""tokcap's weight-transfer backend for vLLM (``tokcap_shm``), for trainer code written
against vLLM's `WeightTransferTrainerFactory`. Importing this module imports vLLM and torch.

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    engine = WeightTransferTrainerFactory.trainer_init(
        TokcapShmTrainerInitInfo(rank=0),
        client=BearerWeightSyncClient(url, token),
        source=StateDictSource(model.state_dict()),
    )
    engine.send_weights()  # start, update, finish; pausing and the prefix-cache reset are
                           # yours (tokcap_vllm.weights.GateWeightClient does all of it)
"""

from ._transfer import (
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
    "BearerWeightSyncClient",
    "StateDictSource",
    "TokcapShmInitInfo",
    "TokcapShmTrainerInitInfo",
    "TokcapShmTrainerWeightTransferEngine",
    "TokcapShmUpdateInfo",
    "TokcapShmWeightTransferEngine",
]
