"""What ``tokcap train`` trains: `LoopConfig` (the task, the sizes, sync or async)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokcap_core import ConfigError

from ._task import HARNESS_APIS, TASKS, HarnessApi, Task

__all__ = ["MODEL_FAMILIES", "LoopConfig", "ModelFamily"]

ModelFamily = Literal["qwen", "idefics3"]
MODEL_FAMILIES: tuple[ModelFamily, ...] = ("qwen", "idefics3")
"""The tiny models ``tokcap train --model-family`` trains: ``qwen`` (text, the default) and
``idefics3`` (a vision-language model; every rollout's first message carries an image)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopConfig:
    """What to train: ``steps`` steps of ``groups`` x ``rollouts`` chats of ``turns`` calls."""

    model: Path
    steps: int = 40
    groups: int = 4
    rollouts: int = 8
    turns: int = 2
    task: Task = "agent"
    """``agent``: a tool response from the environment between calls; ``digits``: a user
    asks for more (`tokcap.loop._task`)."""
    harness_api: HarnessApi = "chat"
    """The API the harness speaks (`tokcap.loop._task.HARNESS_APIS`)."""
    max_tokens: int = 16
    lr: float = 1e-2
    seed: int = 0
    workers: int = 2
    concurrency: int = 32
    """Chats in flight at once (sync: the step's; async: the rollout pump's, see
    `async_in_flight`)."""
    async_in_flight: int | None = None
    """Async: groups the rollout pump keeps in flight (None: ``2 * groups``, so the engine
    batches twice a step's chats while the train pump trains)."""
    tag: str = "train"
    max_seq_len: int = 4096
    ray_address: str | None = None
    """An existing Ray cluster to run TransferQueue and the pool on (None: start one here)."""
    gates: int = 0
    """Start this many ``tokcap-vllm serve`` gates (0: one gate in this process)."""
    gate_urls: tuple[str, ...] = ()
    """Gates someone else started (``--tokcap-sink tq`` on ``ray_address``'s cluster)."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: generate, then collect, train, push (staleness 0). ``async``: a rollout
    pump and a train pump overlap, weights pushed in flight (`tokcap.loop._async`)."""
    max_staleness: int = 2
    """Async: the most versions a trained token may lag the version being trained."""
    max_skipped: int | None = None
    """Async: groups the run may discard (stale, too few valid) before it stops (None:
    ``max(groups, steps * groups // 2)``)."""
    importance: bool | None = None
    """Decoupled PPO with TIS/MIS from the engine's logprobs (None: on in async mode)."""
    model_family: ModelFamily = "qwen"
    """The tiny model trained (`MODEL_FAMILIES`); ``idefics3`` plays chat with one image per
    group, staged once in the sink and read back, verified, by the trainer."""

    @property
    def images(self) -> bool:
        """Whether the family sees images (the harness sends one per rollout)."""
        return self.model_family == "idefics3"

    @property
    def skip_bound(self) -> int:
        """`max_skipped`, resolved."""
        if self.max_skipped is not None:
            return self.max_skipped
        return max(self.groups, self.steps * self.groups // 2)

    @property
    def groups_in_flight(self) -> int:
        """`async_in_flight`, resolved."""
        return self.async_in_flight or 2 * self.groups

    @property
    def push_mode(self) -> Literal["wait", "recompute"]:
        """How pushes treat calls in flight: ``wait`` (sync: none run) or ``recompute``
        (async: they continue on the new weights, their KV recomputed by them)."""
        return "recompute" if self.mode == "async" else "wait"

    @property
    def decoupled(self) -> bool:
        """Whether the loss takes importance weights against the engine (`importance`)."""
        return self.mode == "async" if self.importance is None else self.importance

    def __post_init__(self) -> None:
        for name in ("steps", "groups", "rollouts", "turns", "max_tokens", "workers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"bad_{name}", f"{name} must be an int >= 1: {value!r}")
        if self.task not in TASKS:
            raise ConfigError("bad_task", f"task is one of {TASKS}: {self.task!r}")
        if self.harness_api not in HARNESS_APIS:
            raise ConfigError(
                "bad_harness_api", f"harness_api is one of {HARNESS_APIS}: {self.harness_api!r}"
            )
        if self.model_family not in MODEL_FAMILIES:
            raise ConfigError(
                "bad_model_family",
                f"model_family is one of {MODEL_FAMILIES}: {self.model_family!r}",
            )
        if self.images and (self.harness_api != "chat" or self.gates or self.gate_urls):
            raise ConfigError(
                "bad_model_family",
                "the idefics3 family plays chat completions on one gate in this process",
            )
        if self.task == "agent" and self.turns < 2:
            raise ConfigError(
                "bad_turns", "the agent task needs >= 2 calls (a tool result between)"
            )
        if self.rollouts < 2:
            raise ConfigError("bad_rollouts", "GRPO needs >= 2 rollouts per group")
        if type(self.gates) is not int or self.gates < 0:
            raise ConfigError("bad_gates", f"gates must be an int >= 0: {self.gates!r}")
        if self.gate_urls and (self.gates or not self.ray_address):
            raise ConfigError(
                "bad_gates", "--gate URL needs --ray-address and no --gates (they are started)"
            )
        if self.mode not in ("sync", "async"):
            raise ConfigError("bad_mode", f"mode is 'sync' or 'async': {self.mode!r}")
        for name in ("max_staleness", "max_skipped"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"bad_{name}", f"{name} must be an int >= 0: {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("bad_lr", f"lr must be finite and > 0: {self.lr!r}")
