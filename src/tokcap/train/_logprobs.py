"""Recompute, with a transformers causal LM, the logprob of every token given the ones before."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ._batch import Batch

__all__ = ["token_logprobs"]


def token_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` float32: ``log p(input_ids[t] | input_ids[:t])``; column 0 (no context) is 0.0.

    The logits are divided by ``temperature`` before the softmax, which is what vLLM
    reports with ``--logprobs-mode processed_logprobs`` (its default ``raw_logprobs``
    reports the T=1 distribution whatever the sampling temperature). The softmax is a
    float32 ``log_softmax`` then a gather, as in vLLM's sampler, so an fp32 trainer and
    an fp32 engine agree to ~1e-7. Gradients flow unless the caller disables them.
    ``inputs`` go to the model as well (a vision-language model's image tensors,
    `tokcap.train.media_inputs`).
    """
    out = model(
        input_ids=batch.input_ids_B_T, attention_mask=batch.attention_mask_B_T, **(inputs or {})
    )
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.input_ids_B_T[:, 1:].unsqueeze(-1)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)
    return F.pad(picked, (1, 0))
