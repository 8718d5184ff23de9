"""What it takes to run TRL 1.16's ``AsyncGRPOTrainer`` on CPU: two replacements, tests only.

As shipped, ``trl.experimental.async_grpo.AsyncGRPOTrainer`` does not start without CUDA:

1. ``__init__`` calls ``trl.trainer.utils.get_peak_flops_per_device``, which calls
   ``torch.cuda.get_device_name`` (an error without a CUDA device). Replaced, in the
   trainer's module only, by a function returning ``None``: the value TRL itself uses for
   "peak FLOPs unknown", which turns off the MFU metrics and nothing else.
2. The first forward runs the trainer's tree attention (``packing.tree_attention``), which
   fetches the CUDA-only FlashAttention-3 kernel from the Hugging Face Hub
   (``packing._flash_attn``: ``kernels.get_kernel("kernels-community/flash-attn3")``).
   Replaced by `CpuVarlenAttention`, the same ``flash_attn_varlen_func`` contract in plain
   torch: each query segment attends causally (bottom-right aligned, as FlashAttention
   does when ``seqlen_k > seqlen_q``) to its gathered root-to-segment K/V path. Sliding
   windows and soft-capping are refused, not approximated (the tiny Qwen3 uses neither).

Both are private TRL names, so `cpu_async_grpo` asserts TRL is exactly 1.16.0 and that the
names it replaces still exist with the expected shape; a TRL upgrade fails here loudly
instead of silently running TRL's GPU path or a stale replacement. Nothing in
``packages/`` uses this: a user on GPU runs TRL unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TRL_VERSION", "CpuVarlenAttention", "cpu_async_grpo"]

TRL_VERSION = "1.16.0"
"""The one TRL release these replacements were read against."""


class CpuVarlenAttention:
    """``flash_attn_varlen_func`` of FlashAttention in plain torch (CPU), for tree packing.

    ``q``: ``[total_q, heads, dim]``; ``k``, ``v``: ``[total_k, kv_heads, dim]`` (grouped
    query attention when ``kv_heads < heads``). Segment ``s`` has queries
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``;
    with ``causal`` the queries are the last ones of the keys (query ``i`` of ``Lq`` sees
    keys ``0 .. Lk - Lq + i``).
    """

    calls = 0
    """How many times it ran (a test checks the trainer went through it)."""

    @classmethod
    def flash_attn_varlen_func(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        **unsupported: Any,
    ) -> torch.Tensor:
        if tuple(window_size) != (-1, -1) or unsupported:
            raise NotImplementedError(
                f"CPU tree attention: no sliding window / {sorted(unsupported)} (got {window_size})"
            )
        cls.calls += 1
        heads, kv_heads = q.shape[1], k.shape[1]
        out = torch.empty_like(q)
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for s in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
            lq, lk = q1 - q0, k1 - k0
            query = q[q0:q1].transpose(0, 1)  # [heads, lq, dim]
            key = k[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            value = v[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            mask = None
            if causal:
                rows = torch.arange(lq).unsqueeze(1)
                cols = torch.arange(lk).unsqueeze(0)
                mask = cols <= rows + (lk - lq)
            attended = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=softmax_scale
            )
            out[q0:q1] = attended.transpose(0, 1)
        return out


def _no_peak_flops(accelerator: object, dtype: str) -> None:
    """Peak FLOPs unknown (TRL's own ``None``): MFU metrics off, everything else unchanged."""
    return None


def _check_pinned() -> tuple[Any, Any]:
    import trl
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(
            f"tests/trl/_async_cpu.py replaces private names of TRL {TRL_VERSION}; this is "
            f"TRL {trl.__version__}: re-read async_grpo_trainer.py and packing.py and update it"
        )
    flops = getattr(async_grpo_trainer, "get_peak_flops_per_device", None)
    kernel = getattr(packing, "_flash_attn", None)
    if flops is None or list(inspect.signature(flops).parameters) != ["accelerator", "dtype"]:
        raise RuntimeError("TRL's async_grpo_trainer.get_peak_flops_per_device changed shape")
    if kernel is None or "_flash_attn()" not in inspect.getsource(packing.tree_attention):
        raise RuntimeError(
            "TRL's packing.tree_attention no longer fetches its kernel via _flash_attn"
        )
    return async_grpo_trainer, packing


@contextlib.contextmanager
def cpu_async_grpo() -> Iterator[None]:
    """TRL 1.16's ``AsyncGRPOTrainer`` runnable on CPU while inside (see the module)."""
    trainer_module, packing = _check_pinned()
    saved = trainer_module.get_peak_flops_per_device, packing._flash_attn
    trainer_module.get_peak_flops_per_device = _no_peak_flops
    packing._flash_attn = lambda: CpuVarlenAttention
    try:
        yield
    finally:
        trainer_module.get_peak_flops_per_device, packing._flash_attn = saved
