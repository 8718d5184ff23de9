"""A clipped token-level policy-gradient loss whose ratio is taken against the engine.

Per token, ``ratio = exp(logprob - engine_logprob)`` and the loss is PPO's
``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`` with the row's
advantage ``A`` broadcast over its tokens. The engine's logprobs are the behaviour
policy: the tokens were sampled from them, so no second "old policy" forward pass is
needed, and when trainer and engine agree (same weights, fp32) the first step's ratio is
exactly what the parity report says it is. Tokens are averaged over the whole batch
(token mean, as in DAPO), so a long row weighs by its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossStats", "policy_loss"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LossStats:
    """What one loss computation saw, over the loss tokens."""

    tokens: int
    clip_fraction: float
    """Share of loss tokens whose ratio was clipped (the clipped term won)."""
    ratio_mean: float
    ratio_max: float


def policy_loss(
    logprobs_B_T: torch.Tensor,
    engine_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_B_T: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    proximal_logprobs_B_T: torch.Tensor | None = None,
    behaviour_weights_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The scalar loss (token mean over ``loss_mask_B_T``) and its `LossStats`.

    ``clip_high`` defaults to ``clip_low`` (symmetric PPO clip); a larger one is DAPO's
    clip-higher. Values outside the mask never reach the loss, not even as NaN. With no
    loss token the loss is a zero that still carries a graph.

    Decoupled PPO (for rows sampled by older weights): with ``proximal_logprobs_B_T`` (the
    trainer's own pre-update logprobs, detached) the ratio is taken against them instead of
    the engine's, and each token's clipped term is multiplied by ``behaviour_weights_B_T``
    (the importance weight proximal/behaviour, truncated: TIS, and 0.0 for masked-out rows:
    MIS), so the trust region is around the current policy and the off-policy gap is
    corrected by the weight.
    """
    high = clip_low if clip_high is None else clip_high
    mask = loss_mask_B_T.bool()
    anchor = engine_logprobs_B_T if proximal_logprobs_B_T is None else proximal_logprobs_B_T
    log_ratio = torch.where(mask, logprobs_B_T - anchor, 0.0)
    ratio = torch.exp(log_ratio)
    advantages = advantages_B.to(ratio.dtype).unsqueeze(-1)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if behaviour_weights_B_T is not None:
        per_token = per_token * behaviour_weights_B_T.to(per_token.dtype)
    per_token = torch.where(mask, per_token, 0.0)
    tokens = int(mask.sum())
    loss = per_token.sum() / max(tokens, 1)
    with torch.no_grad():
        kept = ratio[mask]
        stats = LossStats(
            tokens=tokens,
            clip_fraction=float((clipped > unclipped)[mask].float().mean()) if tokens else 0.0,
            ratio_mean=float(kept.mean()) if tokens else 1.0,
            ratio_max=float(kept.max()) if tokens else 1.0,
        )
    return loss, stats
