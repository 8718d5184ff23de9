"""One policy-gradient step on captured rows, with a parity report and the batch's staleness.

A step: collate the rows, recompute every token's logprob with the model (one forward
pass, with gradients), compare those pre-update logprobs with the engine's
(`tokcap_core.logprob_parity`: K3 ~ 1e-14 in fp32 when the engine holds the trainer's
weights, so a large value means the last push did not land), take the clipped
token-level loss against the engine's logprobs, step the optimizer, bump the version.
The trainer's ``version`` names the weights it holds; push them to the engine under
that version (`weights`), so the rows sampled next carry it and staleness stays 0 in a
synchronous loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tokcap_core import ConfigError, LogprobParity, TrainingRow, logprob_parity
from tokcap_core.parity import sequence_ratio_mask, truncated_importance_weights
from tokcap_core.staged import TensorBytes

from ._batch import TrainInputError, collate
from ._logprobs import token_logprobs
from ._loss import policy_loss
from ._media import media_inputs

__all__ = ["StepReport", "TrainConfig", "Trainer", "staleness"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """Loss and step settings; see `policy_loss` and `token_logprobs`."""

    temperature: float = 1.0
    """The sampling temperature the engine used (its logprobs must be ``processed_logprobs``)."""
    clip_low: float = 0.2
    clip_high: float | None = None
    """Defaults to ``clip_low``."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient's global norm; None: no clipping."""
    pad_token_id: int = 0
    decoupled: bool = False
    """Decoupled PPO: clip around the trainer's pre-update logprobs (the proximal policy) and
    weight each token by proximal/engine (the behaviour policy that sampled it), truncated at
    ``tis_cap`` (TIS); a row whose per-token geometric-mean ratio leaves ``mis_band`` is
    masked out (MIS). Off: the ratio is taken against the engine's logprobs."""
    tis_cap: float = 2.0
    mis_band: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        checks = {
            "temperature": self.temperature,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "max_grad_norm": self.max_grad_norm,
        }
        for name, value in checks.items():
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"bad_{name}", f"{name} must be finite and > 0: {value!r}")
        if self.clip_low >= 1:
            raise ConfigError("bad_clip_low", f"clip_low must be < 1: {self.clip_low!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """What one `Trainer.step` did."""

    version: int
    """The trainer's weight version after the step (push the weights under it)."""
    loss: float
    parity: LogprobParity
    """The pre-update recompute against the engine's logprobs, over the loss tokens."""
    staleness_max: int | None
    """Version before the step minus the oldest version that sampled a row (None: no valid row)."""
    rows_valid: int
    rows_placeholder: int
    tokens: int
    clip_fraction: float
    ratio_max: float
    grad_norm: float | None
    """The gradient's global norm before clipping (None: no step was taken)."""
    parity_by_staleness: dict[int, LogprobParity] = field(default_factory=dict)
    """``parity`` over the valid rows of each staleness (version minus ``weight_version_min``)."""
    is_weight_mean: float = 1.0
    """Decoupled: the mean truncated importance weight over kept loss tokens."""
    rows_masked: int = 0
    """Decoupled: valid rows MIS masked out of the loss."""


def _parity_by_staleness(
    rows: Sequence[TrainingRow], trainer_N: list[list[float]], version: int
) -> dict[int, LogprobParity]:
    """Parity over the valid rows of each staleness (``version - weight_version_min``)."""
    buckets: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if row.sample_mask and row.weight_version_min is not None:
            buckets.setdefault(version - row.weight_version_min, []).append(i)
    return {
        s: logprob_parity(
            [rows[i].logprobs for i in members],
            [trainer_N[i] for i in members],
            [rows[i].loss_mask for i in members],
        )
        for s, members in sorted(buckets.items())
    }


def staleness(rows: Sequence[TrainingRow], version: int) -> int | None:
    """``version`` minus the oldest ``weight_version_min`` of the valid rows (None if none)."""
    oldest = [
        row.weight_version_min
        for row in rows
        if row.sample_mask and row.weight_version_min is not None
    ]
    return version - min(oldest) if oldest else None


class Trainer:
    """A model, its optimizer and the version of the weights it holds.

    The model must be a transformers causal LM (``model(input_ids=..., attention_mask=...)
    .logits``) without dropout (eval mode), in the dtype the engine runs (fp32 on CPU), or
    parity is lost. ``version`` starts at the version the engine serves.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        config: TrainConfig | None = None,
        version: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = TrainConfig() if config is None else config
        self.version = version

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the batch is collated there)."""
        return next(self.model.parameters()).device

    def step(
        self,
        rows: Sequence[TrainingRow],
        advantages_N: Sequence[float],
        *,
        media: Mapping[str, Sequence[TensorBytes]] | None = None,
    ) -> StepReport:
        """One optimizer step on ``rows`` with one advantage per row (0.0 for placeholders).

        ``media``: the processed tensors of the images the rows name, by tensors digest, as
        `tokcap_core.sink.fetch_media` read and verified them (`media_inputs`). A batch
        without a loss token (all placeholders) takes no step and keeps the version. Raises
        `TrainInputError` (``no_rows``, ``advantages_mismatch``, ``non_finite_advantage``,
        ``media_missing``).
        """
        if len(advantages_N) != len(rows):
            raise TrainInputError(
                "advantages_mismatch", f"{len(advantages_N)} advantages for {len(rows)} rows"
            )
        if not all(math.isfinite(a) for a in advantages_N):
            raise TrainInputError("non_finite_advantage", "every advantage must be finite")
        config = self.config
        batch = collate(rows, pad_token_id=config.pad_token_id, device=self.device)
        images = media_inputs(rows, media or {}, device=self.device)
        logprobs = token_logprobs(self.model, batch, temperature=config.temperature, inputs=images)
        pre_update = logprobs.detach().cpu()
        trainer_N = [pre_update[i, : len(row.input_ids)].tolist() for i, row in enumerate(rows)]
        parity = logprob_parity(
            [row.logprobs for row in rows],
            trainer_N,
            [row.loss_mask for row in rows],
            valid_N=[row.sample_mask for row in rows],
        )
        weights, masked, weight_mean = (
            self._importance(rows, trainer_N) if config.decoupled else (None, 0, 1.0)
        )
        advantages = torch.tensor(advantages_N, dtype=torch.float32, device=self.device)
        loss, stats = policy_loss(
            logprobs,
            batch.engine_logprobs_B_T,
            advantages,
            batch.loss_mask_B_T,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            proximal_logprobs_B_T=logprobs.detach() if config.decoupled else None,
            behaviour_weights_B_T=weights,
        )
        grad_norm = self._update(loss) if stats.tokens else None
        valid = int(batch.sample_mask_B.sum())
        report = StepReport(
            version=self.version + (grad_norm is not None),
            loss=float(loss.detach()),
            parity=parity,
            staleness_max=staleness(rows, self.version),
            rows_valid=valid,
            rows_placeholder=len(rows) - valid,
            tokens=stats.tokens,
            clip_fraction=stats.clip_fraction,
            ratio_max=stats.ratio_max,
            grad_norm=grad_norm,
            parity_by_staleness=_parity_by_staleness(rows, trainer_N, self.version),
            is_weight_mean=weight_mean,
            rows_masked=masked,
        )
        self.version = report.version
        return report

    def _importance(
        self, rows: Sequence[TrainingRow], trainer_N: list[list[float]]
    ) -> tuple[torch.Tensor, int, float]:
        """``[B, T]`` TIS weights (0.0 on MIS-masked rows), rows masked, mean kept weight."""
        config = self.config
        engine_N = [row.logprobs for row in rows]
        mask_N = [row.loss_mask for row in rows]
        valid_N = [row.sample_mask for row in rows]
        tis = truncated_importance_weights(
            engine_N, trainer_N, mask_N, cap=config.tis_cap, valid_N=valid_N
        )
        low, high = config.mis_band
        kept = sequence_ratio_mask(engine_N, trainer_N, mask_N, low=low, high=high, valid_N=valid_N)
        width = max(len(row.input_ids) for row in rows)
        weights = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (row_weights, keep) in enumerate(zip(tis, kept, strict=True)):
            if keep:
                weights[i, : len(row_weights)] = torch.tensor(row_weights, dtype=torch.float32)
        kept_tokens = [
            w
            for i, ws in enumerate(tis)
            if kept[i]
            for w, m in zip(ws, mask_N[i], strict=True)
            if m
        ]
        masked = sum(valid_N) - sum(kept)
        mean = sum(kept_tokens) / len(kept_tokens) if kept_tokens else 1.0
        return weights.to(self.device), masked, mean

    def _update(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        params = [p for p in self.model.parameters() if p.grad is not None]
        # An infinite bound measures the norm and scales every gradient by exactly 1.0.
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm or math.inf)
        self.optimizer.step()
        return float(norm)

    def weights(self) -> dict[str, torch.Tensor]:
        """The full state dict to push, detached: tied weights (``lm_head.weight``) included.

        ``named_parameters()`` would omit a tied ``lm_head.weight``; an engine that keeps
        a packed copy of it (vLLM on CPU) then serves a stale head. Do not step the
        optimizer until the push that reads these tensors has returned.
        """
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
