"""The trainer's side of ``tokcap train``: its copy of the engine's model, and its optimizer.

`load_policy` loads the model the engine serves, fp32 in eval mode; `PolicyLoad` does so in
a worker thread while the run's stack starts (`tokcap.compose.Site.open`'s ``alongside``);
`new_trainer` wraps it in a `tokcap.train.Trainer` (AdamW, temperature 1) at the engines'
weight version.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from ..train import Trainer

__all__ = ["PolicyLoad", "load_policy", "new_trainer", "preload_policy_imports"]


def preload_policy_imports() -> None:
    """Import what `load_policy` needs, on this thread, before a run starts its threads.

    With ``accelerate`` installed (TRL brings it), transformers' generation module imports
    it, and two threads importing accelerate's circular package at once fail ("partially
    initialized module 'accelerate.hooks'"): the policy loads in a worker thread while the
    in-process engine starts in another.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: F401


def load_policy(model: Path, seed: int, *, vision: bool = False) -> Any:
    """The trainer's copy of the engine's model: fp32, eval mode (no dropout); ``vision``:
    a vision-language model (``AutoModelForImageTextToText``)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    policy = auto.from_pretrained(model, dtype=torch.float32)
    policy.train(False)  # eval mode: no dropout
    return policy


def new_trainer(model: Any, lr: float, version: int, *, decoupled: bool = False) -> Trainer:
    """A `tokcap.train.Trainer` of ``model`` (AdamW at ``lr``, temperature 1) at ``version``;
    ``decoupled``: decoupled PPO with TIS/MIS (`tokcap.train.TrainConfig.decoupled`)."""
    import torch

    from ..train import TrainConfig, Trainer

    # a config's pad id may lie outside the vocabulary (the tiny Idefics3's): pad with 0
    pad = getattr(model.config, "pad_token_id", None)
    if not isinstance(pad, int) or not 0 <= pad < model.get_input_embeddings().num_embeddings:
        pad = 0
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=lr),
        config=TrainConfig(temperature=1.0, pad_token_id=pad, decoupled=decoupled),
        version=version,
    )


class PolicyLoad:
    """``model``'s policy (`load_policy`, seeded ``seed``, ``vision`` or not), loaded by
    `load` in a worker thread; ``policy`` once loaded."""

    def __init__(self, model: Path, seed: int, *, vision: bool = False) -> None:
        self.model, self.seed, self.vision = model, seed, vision
        self.policy: Any = None

    async def load(self) -> None:
        """Load the policy (`preload_policy_imports` first, on the caller's thread)."""
        self.policy = await anyio.to_thread.run_sync(
            functools.partial(load_policy, self.model, self.seed, vision=self.vision)
        )
