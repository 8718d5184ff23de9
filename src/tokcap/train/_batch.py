"""Collate training rows into one right-padded batch of tensors, straight from their buffers.

A `TrainingRow` keeps its tokens, loss mask and engine logprobs in ``array`` buffers
(``I`` u32, ``B`` u8, ``f`` f32). ``torch.frombuffer`` views each without copying, and
the one copy made is into the padded batch: no Python object per token.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokcap_core import TokcapError, TrainingRow

__all__ = ["Batch", "TrainInputError", "collate"]


class TrainInputError(TokcapError, ValueError):
    """Bad trainer input: no rows, advantages not one per row, a non-finite advantage."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """B rows right-padded to T tokens (suffixes give the shape).

    ``loss_mask_B_T`` is the row's loss mask AND its ``sample_mask``: True exactly on
    the generated tokens of valid rows. ``engine_logprobs_B_T`` is the logprob the
    engine reported for each of those tokens (0.0 elsewhere).
    """

    input_ids_B_T: torch.Tensor
    """int64 token ids; padding is ``pad_token_id``."""
    attention_mask_B_T: torch.Tensor
    """int64, 1 on the row's tokens, 0 on padding."""
    loss_mask_B_T: torch.Tensor
    engine_logprobs_B_T: torch.Tensor
    sample_mask_B: torch.Tensor
    """bool, False for placeholder rows."""
    rows: tuple[TrainingRow, ...]

    @property
    def tokens(self) -> int:
        """How many tokens the loss is computed on."""
        return int(self.loss_mask_B_T.sum())


def _view(buffer: array[int] | array[float], dtype: torch.dtype) -> torch.Tensor:
    """A zero-copy tensor over an ``array`` (its item size must be ``dtype``'s)."""
    if buffer.itemsize != torch.empty((), dtype=dtype).element_size():
        raise TrainInputError("bad_buffer", f"array {buffer.typecode!r} is not {dtype}")
    return torch.frombuffer(buffer, dtype=dtype)


def collate(
    rows: Sequence[TrainingRow],
    *,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
) -> Batch:
    """Stack ``rows`` (placeholders included) into a right-padded `Batch` on ``device``.

    Right padding keeps every real token at its own position, so no position ids are
    needed. Raises `TrainInputError` (``no_rows``) for an empty sequence.
    """
    if not rows:
        raise TrainInputError("no_rows", "collate needs at least one row")
    b, t = len(rows), max(len(row.input_ids) for row in rows)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((b, t), dtype=torch.int64)
    loss_mask = torch.zeros((b, t), dtype=torch.bool)
    engine = torch.zeros((b, t), dtype=torch.float32)
    sample_mask = torch.tensor([row.sample_mask == 1 for row in rows], dtype=torch.bool)
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        if n == 0:  # frombuffer refuses empty buffers
            continue
        input_ids[i, :n] = _view(row.input_ids, torch.uint32)
        attention[i, :n] = 1
        if row.sample_mask:
            loss_mask[i, :n] = _view(row.loss_mask, torch.uint8) != 0
            engine[i, :n] = _view(row.logprobs, torch.float32)
    engine.masked_fill_(~loss_mask, 0.0)
    return Batch(
        input_ids_B_T=input_ids.to(device),
        attention_mask_B_T=attention.to(device),
        loss_mask_B_T=loss_mask.to(device),
        engine_logprobs_B_T=engine.to(device),
        sample_mask_B=sample_mask.to(device),
        rows=tuple(rows),
    )
