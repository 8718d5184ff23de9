"""``trl.GRPOTrainer`` through tokcap gates: a ``rollout_func`` and a weight-push callback.

`GRPORollouts` is what a TRL user passes as ``rollout_func``: TRL calls it with the
batch's prompts (each repeated ``num_generations`` times, one after another) and the
trainer. It maps each run of ``num_generations`` equal prompts to one tokcap group, plays
every rollout through the fleet with the harness (`Collector`), and returns the verified
rows in TRL's shape (`trl_rollout_output`: one row per rollout, invalid ones as dummy
rows). Before playing, it checks that every gate serves the weights of TRL's current step
(``weight_version_mismatch`` otherwise): rollouts of a stale policy are refused, not
trained on silently.

`WeightPushCallback` (`GRPORollouts.callback`) keeps that true: after every optimizer step
it pushes the model's whole ``state_dict()`` (a tied ``lm_head.weight`` included) to every
gate at version ``state.global_step`` (`tokcap_vllm.weights.FleetWeightSync`: checked,
then swapped on every gate, or every gate held), and at the start of training it brings
gates behind the trainer's step (a resumed run) up to it. A push that fails raises
`TRLAdapterError` ``weight_push_failed`` out of ``trainer.train()``; nothing waits
silently.

TRL's ``rollout_func`` and callbacks are synchronous; the adapter runs its async clients
on an event loop of its own in a background thread (an ``anyio`` blocking portal) for as
long as its ``with`` block lasts.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio.from_thread
import openai
from transformers import TrainerCallback

from tokcap_core import TokcapError, TokenSink
from tokcap_vllm import GateFleet
from tokcap_vllm.weights import FleetWeightSync, PushTransport, WeightInfo

from ._collect import CollectedBatch, Collector, RolloutPlan
from ._errors import TRLAdapterError
from ._harness import Harness, Prompt
from ._portal import PortalScope
from ._shape import METRICS_KEY, trl_rollout_output

if TYPE_CHECKING:
    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["GRPORollouts", "WeightPushCallback"]


class GRPORollouts(PortalScope):
    """The ``rollout_func`` for ``trl.GRPOTrainer`` over the gates at ``gate_urls``.

    Use it as a context manager around the trainer::

        with GRPORollouts(urls, token=token, sink=TQSink(config), harness=h) as rollouts:
            trainer = GRPOTrainer(..., reward_funcs=[receipt_reward],
                                  rollout_func=rollouts, callbacks=[rollouts.callback])
            trainer.train()

    ``token`` is the gates' control token; ``sink`` the sink they stage into (a
    `tokcap_tq.TQSink` on their TransferQueue); ``harness`` plays one rollout (`Harness`);
    ``model`` the name requests carry (default: what the first gate serves);
    ``max_seq_len`` caps a row; ``concurrency`` bounds the rollouts playing at once;
    ``run_id`` prefixes every rollout id (default: ``trl-`` and random hex);
    ``check_version`` refuses to play on gates that do not serve the trainer's step;
    ``push_transport`` is how weights travel (``"shm"``: gates on this host).
    """

    def __init__(
        self,
        gate_urls: Sequence[str],
        *,
        token: str,
        sink: TokenSink,
        harness: Harness,
        model: str | None = None,
        max_seq_len: int = 4096,
        concurrency: int = 64,
        run_id: str | None = None,
        check_version: bool = True,
        push_transport: PushTransport = "shm",
    ) -> None:
        if not gate_urls:
            raise ValueError("GRPORollouts needs at least one gate url")
        self.gate_urls = [url.rstrip("/") for url in gate_urls]
        self.harness = harness
        self.run_id = run_id or f"trl-{secrets.token_hex(4)}"
        self.check_version = check_version
        self.last: CollectedBatch | None = None
        """The latest batch `__call__` collected (its rollouts, reasons and metrics)."""
        self.batches = 0
        """How many batches this adapter has collected."""
        self._token = token
        self._sink = sink
        self._model = model
        self._max_seq_len = max_seq_len
        self._concurrency = concurrency
        self._transport = push_transport
        self._fleet: GateFleet | None = None
        self._weights: FleetWeightSync | None = None
        self._collector: Collector | None = None
        self._callback = WeightPushCallback(self)

    def __repr__(self) -> str:
        return f"GRPORollouts({self.gate_urls!r}, run_id={self.run_id!r})"

    # ---- lifetime ------------------------------------------------------------------------

    def _open(self, stack: contextlib.ExitStack, portal: anyio.from_thread.BlockingPortal) -> None:
        self._fleet = stack.enter_context(
            portal.wrap_async_context_manager(GateFleet(self.gate_urls, self._token))
        )
        self._weights = stack.enter_context(
            portal.wrap_async_context_manager(
                FleetWeightSync(
                    [(u, self._token) for u in self.gate_urls], transport=self._transport
                )
            )
        )
        model = self._model or portal.call(_served_model, self.gate_urls[0])
        self._collector = Collector(
            self._fleet,
            self._sink,
            model=model,
            max_seq_len=self._max_seq_len,
            concurrency=self._concurrency,
        )

    def _forget(self) -> None:
        self._fleet = self._weights = self._collector = None

    @property
    def callback(self) -> WeightPushCallback:
        """The callback that pushes the weights to every gate after each optimizer step."""
        return self._callback

    @property
    def model(self) -> str:
        """The model name the harness's requests carry."""
        return self._parts()[2].model

    # ---- TRL's rollout_func --------------------------------------------------------------

    def __call__(self, prompts: Sequence[Prompt], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``: play, verify, return rows (see the module)."""
        portal, _, collector, _ = self._parts()
        size = _group_size(trainer)
        step = int(trainer.state.global_step)
        plans = self.plans(prompts, size, batch=self.batches)
        if self.check_version:
            portal.call(self._check_version, step)
        batch = portal.call(collector.collect, plans, self.harness)
        self.batches += 1
        self.last = batch
        if not batch.valid:
            reasons = sorted({c.reason or "" for c in batch.rollouts})
            raise TRLAdapterError(
                "no_valid_rollouts",
                f"none of the {len(plans)} rollouts of step {step} is valid: {', '.join(reasons)}",
            )
        out: dict[str, Any] = trl_rollout_output(
            batch.rollouts, pad_token_id=_pad_token_id(trainer)
        )
        out[METRICS_KEY] = {**batch.metrics, "tokcap/weight_version": float(step)}
        return out

    def plans(self, prompts: Sequence[Prompt], group_size: int, *, batch: int) -> list[RolloutPlan]:
        """One `RolloutPlan` per prompt: TRL's runs of ``group_size`` equal prompts become
        groups (`TRLAdapterError` ``group_mismatch`` if they are not runs)."""
        if group_size < 1 or len(prompts) % group_size:
            raise TRLAdapterError(
                "group_mismatch",
                f"{len(prompts)} prompts do not split into groups of num_generations={group_size}",
            )
        plans = []
        for index, prompt in enumerate(prompts):
            group = index // group_size
            if prompt != prompts[group * group_size]:
                raise TRLAdapterError(
                    "group_mismatch",
                    f"prompt {index} differs from the first of its group of {group_size}: TRL "
                    "repeats each prompt num_generations times in a row",
                )
            plans.append(
                RolloutPlan(
                    rollout_id=f"{self.run_id}-b{batch:06d}-{index:04d}",
                    group_id=f"{self.run_id}-b{batch:06d}-g{group:04d}",
                    prompt=prompt,
                )
            )
        return plans

    # ---- weights -------------------------------------------------------------------------

    def push(self, state: Mapping[str, torch.Tensor], version: int) -> list[WeightInfo]:
        """Push ``state`` (a whole state dict) to every gate as ``version``; every gate's
        `WeightInfo` after. `TRLAdapterError` ``weight_push_failed`` if any gate refused
        (every gate is then held until a push succeeds on all)."""
        portal, _, _, weights = self._parts()
        try:
            return portal.call(weights.push, state, version)
        except TokcapError as e:
            raise TRLAdapterError(
                "weight_push_failed", f"pushing version {version} to the gates failed: {e}"
            ) from e

    def versions(self) -> list[WeightInfo]:
        """Every gate's `WeightInfo` (version, phase), in ``gate_urls`` order."""
        portal, _, _, weights = self._parts()
        return portal.call(weights.infos)

    def fleet_version(self) -> int | None:
        """The version every gate serves (READY, not held); None when they disagree."""
        portal, _, _, weights = self._parts()
        return portal.call(weights.current_version)

    async def _check_version(self, step: int) -> None:
        _, _, _, weights = self._parts()
        version = await weights.current_version()
        if version != step:
            raise TRLAdapterError(
                "weight_version_mismatch",
                f"the gates serve weight version {version}, TRL is at step {step}: add "
                "GRPORollouts.callback to the trainer's callbacks (it pushes the weights after "
                "every step), or start the gates from the checkpoint the trainer resumes",
            )

    def _parts(
        self,
    ) -> tuple[anyio.from_thread.BlockingPortal, GateFleet, Collector, FleetWeightSync]:
        if (
            self._portal is None
            or self._fleet is None
            or self._collector is None
            or self._weights is None
        ):
            raise TRLAdapterError("not_started", "use GRPORollouts inside its `with` block")
        return self._portal, self._fleet, self._collector, self._weights


class WeightPushCallback(TrainerCallback):
    """Pushes the trained weights to every gate after each optimizer step (see the module).

    Get it from `GRPORollouts.callback`; it needs the adapter's ``with`` block to be open.
    """

    def __init__(self, rollouts: GRPORollouts) -> None:
        self.rollouts = rollouts
        self.pushed: list[int] = []
        """The versions this callback pushed, in order."""

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        """Bring gates behind the trainer's step (a resumed run) up to it; refuse gates
        ahead of it (they served weights this run never had)."""
        step = state.global_step
        versions = [info.version for info in self.rollouts.versions()]
        if max(versions) > step:
            raise TRLAdapterError(
                "weight_version_mismatch",
                f"the gates serve weight versions {versions}, ahead of TRL's step {step}: "
                "start the gates afresh for this run",
            )
        if self.rollouts.fleet_version() != step and model is not None:
            self._push(model, step)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        """Push the whole state dict at version ``state.global_step``."""
        if model is None:
            raise TRLAdapterError("weight_push_failed", "TRL gave the callback no model to push")
        self._push(model, state.global_step)

    def _push(self, model: Any, version: int) -> None:
        unwrapped = getattr(model, "module", model)  # a DistributedDataParallel wrapper
        state = {name: t.detach() for name, t in unwrapped.state_dict().items()}
        self.rollouts.push(state, version)
        self.pushed.append(version)


def _group_size(trainer: Any) -> int:
    training = bool(getattr(trainer.model, "training", True))
    size = trainer.num_generations if training else trainer.num_generations_eval
    return int(size)


def _pad_token_id(trainer: Any) -> int:
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    return int(pad)


async def _served_model(url: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2) as client:
        models = await client.models.list()
        return models.data[0].id
