"""A batch's image inputs, from the processed tensors its rows name (verified, never remade).

A row with images names each one's ``tensors_digest`` (`tokcap_core.TrainingRow.media`);
the trainer reads those blobs back from the sink and verifies them
(`tokcap_core.sink.fetch_media`): the very tensors the engine's encoder consumed. No image
processor runs here. `media_inputs` lays them out as a transformers vision-language model
takes them: each tensor the engine holds per patch (``pixel_values`` ``[patches, 3, H, W]``,
``pixel_attention_mask`` ``[patches, H, W]`` for Idefics3) concatenated over the batch's
images, in row order then prompt order, under one leading batch dimension; the model fills
its image placeholders in that same order. Per-image scalars and vectors (Idefics3's
``num_patches``) are implied by the concatenation and left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tokcap_core import TrainingRow
from tokcap_core.staged import TensorBytes

from ._batch import TrainInputError

__all__ = ["media_inputs"]


def _tensor(dtype: str, shape: Sequence[int], data: bytes | memoryview) -> torch.Tensor:
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise TrainInputError("bad_media", f"a media tensor has an unknown dtype {dtype!r}")
    return torch.frombuffer(bytearray(data), dtype=kind).reshape(tuple(shape))


def media_inputs(
    rows: Sequence[TrainingRow],
    tensors: Mapping[str, Sequence[TensorBytes]],
    *,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """The model's image inputs for ``rows`` from ``tensors`` (verified, by tensors
    digest): empty when no row names an image. `TrainInputError` ``media_missing`` for an
    image whose tensors are not given, ``bad_media`` for a dtype torch does not know."""
    parts: dict[str, list[torch.Tensor]] = {}
    for row in rows:
        for item in row.media:
            held = tensors.get(item.tensors_digest)
            if held is None:
                raise TrainInputError(
                    "media_missing", f"no tensors for image {item.tensors_digest} of {row.key}"
                )
            for name, dtype, shape, data in held:
                if len(shape) >= 2:
                    parts.setdefault(name, []).append(_tensor(dtype, shape, data))
    return {name: torch.cat(ts)[None].to(device) for name, ts in parts.items()}
