"""Train a policy on captured rows: the torch side of a closed RL loop.

`collate` turns `tokcap_core.TrainingRow`s into a right-padded `Batch` straight from
their buffers; `token_logprobs` recomputes every token's logprob with a transformers
causal LM (temperature-aware); `policy_loss` is a clipped token-level policy-gradient
loss whose ratio is taken against the engine's captured logprobs; `Trainer.step` ties
them together with an optimizer step and a `tokcap_core.LogprobParity` report of the
pre-update recompute against the engine. Advantages come from the core
(`tokcap_core.grpo`, ...), one per row. Rows with images feed the model the processed
tensors the engine's encoder consumed, read back and verified (`media_inputs`). Push
`Trainer.weights()` into the engine under `Trainer.version` (`tokcap_vllm.WeightSync`) so
the next rows are sampled by them.

This is meant to be read and copied into a custom trainer: each piece is a short
function over tensors.
"""

from ._batch import Batch, TrainInputError, collate
from ._logprobs import token_logprobs
from ._loss import LossStats, policy_loss
from ._media import media_inputs
from ._trainer import StepReport, TrainConfig, Trainer, staleness

__all__ = [
    "Batch",
    "LossStats",
    "StepReport",
    "TrainConfig",
    "TrainInputError",
    "Trainer",
    "collate",
    "media_inputs",
    "policy_loss",
    "staleness",
    "token_logprobs",
]
