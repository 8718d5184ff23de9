"""The trainer's image inputs: verified blobs laid out so one batched forward of rows with
images gives each row the logprobs its own forward gives (no image processor on the
trainer's side: the tensors come from blobs, as the gate stages them)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from tokcap.train import TrainInputError, collate, media_inputs, token_logprobs
from tokcap_core import MemorySink, TrainingRow
from tokcap_core.sink import fetch_media
from tokcap_core.staged import (
    MediaItem,
    embed_mask_digest,
    media_blob,
    processor_fingerprint,
    tensors_digest,
)


def png(seed: int) -> bytes:
    """A 48 x 48 PNG whose colours depend on ``seed``."""
    import io

    from PIL import Image

    image = Image.new("RGB", (48, 48))
    image.putdata(
        [((x * 7 + seed) % 256, (y * 11) % 256, seed) for y in range(48) for x in range(48)]
    )
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm() -> Path:
    from tokcap.tiny import build_tiny_vlm

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return build_tiny_vlm(cache / "vlm")


def processed(vlm: Path, image: bytes, text: str) -> tuple[list[int], list[Any]]:
    """Prompt ids and the per-image tensors (as vLLM holds them: per patch, plus the patch
    count) that transformers' processor makes; a stand-in for the engine's processing."""
    import io

    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    out = processor(text=prompt, images=[pil], return_tensors="pt")
    pixels, mask = out["pixel_values"][0], out["pixel_attention_mask"][0].bool()
    tensors = [
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numpy().tobytes())
        for name, t in (
            ("pixel_values", pixels),
            ("pixel_attention_mask", mask),
            ("num_patches", torch.tensor(pixels.shape[0])),
        )
    ]
    return out["input_ids"][0].tolist(), tensors


def row(rollout_id: str, ids: list[int], tensors: list[Any], fake_id: int) -> TrainingRow:
    """A row of ``ids`` whose one image's placeholder runs from the first to the last
    ``<fake_token_around_image>``, generated tokens its last two."""
    start = ids.index(fake_id)
    end = len(ids) - ids[::-1].index(fake_id)
    item = MediaItem(
        modality="image",
        offset=start,
        length=end - start,
        embed_digest=embed_mask_digest(None, end - start),
        mm_hash=rollout_id,
        bytes_sha256=hashlib.sha256(rollout_id.encode()).hexdigest(),
        tensors_digest=tensors_digest(tensors),
        processor=processor_fingerprint({}),
    )
    n = len(ids)
    return TrainingRow(
        rollout_id=rollout_id,
        segment=0,
        input_ids=array("I", ids),
        loss_mask=array("B", [0] * (n - 2) + [1, 1]),
        logprobs=array("f", [0.0] * n),
        routes=None,
        prompt_len=n - 2,
        call_spans=(),
        weight_version_min=0,
        weight_version_max=0,
        truncated=False,
        reward=None,
        sample_mask=1,
        reason=None,
        terminal_call_id=None,
        media=(item,),
    )


def test_a_batched_forward_on_verified_blobs_equals_each_rows_own(vlm: Path) -> None:
    import anyio
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    model.train(False)
    from transformers import AutoTokenizer

    fake = AutoTokenizer.from_pretrained(vlm).convert_tokens_to_ids("<fake_token_around_image>")
    first, second = (processed(vlm, png(seed), "Write digits.") for seed in (0, 99))
    rows = [
        row("media-a", first[0], first[1], fake),
        row("media-b", second[0] + [5, 6], second[1], fake),
    ]
    blobs = {
        tensors_digest(t): media_blob(t) for t in (first[1], second[1])
    }  # what the gate stages

    async def read() -> Any:
        sink = MemorySink()
        await sink.put_media(blobs)
        return await fetch_media(sink, [item.tensors_digest for r in rows for item in r.media])

    tensors = anyio.run(read)
    with torch.no_grad():
        together = token_logprobs(model, collate(rows), inputs=media_inputs(rows, tensors))
        for i, one in enumerate(rows):
            alone = token_logprobs(model, collate([one]), inputs=media_inputs([one], tensors))
            n = len(one.input_ids)
            torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=0, atol=1e-5)
        # the images matter: the rows' images swapped give other logprobs
        swapped = [
            dataclasses.replace(r, media=(dataclasses.replace(r.media[0], tensors_digest=d),))
            for r, d in zip(
                rows,
                [rows[1].media[0].tensors_digest, rows[0].media[0].tensors_digest],
                strict=True,
            )
        ]
        assert swapped[0].media[0].length == rows[1].media[0].length  # same size: 34 tokens
        other = token_logprobs(model, collate(swapped), inputs=media_inputs(swapped, tensors))
        assert not torch.allclose(other, together, rtol=0, atol=1e-5)
    with pytest.raises(TrainInputError) as info:
        media_inputs(rows, {})
    assert info.value.code == "media_missing"
