"""tokcap adapter for Hugging Face TRL: verified, token-exact rollouts for ``GRPOTrainer``.

The trainer side of a tokcap deployment, for TRL users: rollouts are played by a harness
(yours, or `chat_harness`) against gates (``tokcap-vllm serve``), every receipt is
verified, and TRL gets the engine's exact token ids, loss mask and logprobs back; after
each optimizer step the new weights are pushed to every gate.

- `GRPORollouts`: the ``rollout_func`` for ``trl.GRPOTrainer`` (and, through
  `GRPORollouts.callback`, the `WeightPushCallback` that pushes the weights);
- `receipt_reward`: the reward function that hands TRL each receipt's reward;
- the collection layer they share, for other TRL workers: `Collector` (open, play,
  close, verify, rebuild, release), `RolloutPlan`, `Collected`, `CollectedBatch`;
- harnesses: `Harness` (the callable you give), `Episode`, `Scored`, `chat_harness`;
- `trl_rollout_output` (collected rows in ``rollout_func``'s shape) and its extra keys;
- for ``trl.experimental.async_grpo.AsyncGRPOTrainer``: `AsyncGRPOGates`, which holds its
  ``rollout_worker`` (`GateRolloutWorker`) and ``weight_transfer`` (`GateWeightTransfer`,
  versions counted in `PolicyVersions`); `group_samples` makes a group's ``RolloutSample``s
  (docs/trl-async.md).

See docs/trl.md ("Using tokcap with TRL").
"""

from . import _shape
from ._async_gates import AsyncGRPOGates
from ._async_samples import GroupSamples, group_samples
from ._async_transfer import GateWeightTransfer, PolicyVersions
from ._async_worker import GateRolloutWorker
from ._collect import (
    CLOSE_FAILED,
    HARNESS_FAILED,
    Collected,
    CollectedBatch,
    Collector,
    RolloutPlan,
)
from ._errors import TRLAdapterError
from ._grpo import GRPORollouts, WeightPushCallback
from ._harness import Episode, Harness, Prompt, Scored, chat_harness, prompt_messages
from ._shape import *  # noqa: F403  (the row shape TRL reads: its keys, the reward)

__all__ = [
    *_shape.__all__,
    "CLOSE_FAILED",
    "HARNESS_FAILED",
    "AsyncGRPOGates",
    "Collected",
    "CollectedBatch",
    "Collector",
    "Episode",
    "GRPORollouts",
    "GateRolloutWorker",
    "GateWeightTransfer",
    "GroupSamples",
    "Harness",
    "PolicyVersions",
    "Prompt",
    "RolloutPlan",
    "Scored",
    "TRLAdapterError",
    "WeightPushCallback",
    "chat_harness",
    "group_samples",
    "prompt_messages",
]
