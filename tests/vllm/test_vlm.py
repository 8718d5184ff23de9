"""The tiny Idefics3 on vLLM's CPU engine: images served, the engine's expanded ids pinned.

One engine for the module, the tiny VLM (`tokcap.tiny.build_tiny_vlm`) behind the gate; the
harness is the real ``openai`` client over HTTP on 127.0.0.1. Images travel as base64 PNG
data URLs; the reference for the expanded prompt is transformers' own processor saved with
the model, run on the same pixels.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.vllm._helpers import CONTROL_TOKEN
from tokcap.tiny import IMAGE_TOKEN, VLM_VLLM_ARGS, build_tiny_vlm
from tokcap_core import CaptureConfig, MemorySink
from tokcap_vllm import Gate, GateConfig, InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of ``width`` x ``height`` pixels whose colours depend on ``seed``."""
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata(
        [((x * 7 + seed) % 256, (y * 11 + seed) % 256, (x * y + seed) % 256)
         for y in range(height) for x in range(width)]
    )  # fmt: skip
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(data: bytes, text: str = "What is in the picture?") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(data)}},
            {"type": "text", "text": text},
        ],
    }


@pytest.fixture(scope="module")
def vlm() -> Path:
    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return build_tiny_vlm(cache / "vlm")


@pytest.fixture(scope="module")
def vlm_server(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    config = GateConfig(
        parent_commit_timeout_s=30,
        capture=CaptureConfig(control_token=CONTROL_TOKEN, return_token_ids=True),
        ledger_path=str(tmp_path_factory.mktemp("vlm-gate") / "ledger.jsonl"),
    )
    srv = InProcessServer(str(vlm), gate=Gate(config, sink=MemorySink()), vllm_args=VLM_VLLM_ARGS)
    srv.start()
    yield srv
    srv.stop()


def processor_ids(model: Path, messages: list[dict[str, Any]], images: list[bytes]) -> list[int]:
    """The prompt ids transformers' processor (saved with the model) makes of ``messages``."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    parts = [
        [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
        if isinstance(m["content"], list)
        else m["content"]
        for m in messages
    ]
    chat = [{"role": m["role"], "content": c} for m, c in zip(messages, parts, strict=True)]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    ids: list[int] = processor(text=text, images=pil)["input_ids"][0]
    return list(ids)


def test_engine_expands_images_as_the_processor_does(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """Uncaptured (plain ``/v1``): vLLM's expanded prompt ids equal transformers' processor's,
    for a square and a wide image; each square image is 2x2 tiles + a global view."""
    from transformers import AutoTokenizer

    image_id = AutoTokenizer.from_pretrained(vlm).convert_tokens_to_ids(IMAGE_TOKEN)
    oai = openai.OpenAI(base_url=f"{vlm_server.base_url}/v1", api_key="x", max_retries=0)
    for size in ((48, 48), (96, 40)):
        data = png(*size, seed=size[0])
        messages = [image_message(data)]
        reply = oai.chat.completions.create(
            model=str(vlm),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"return_token_ids": True},
        )
        engine_ids = (reply.model_extra or {})["prompt_token_ids"]
        assert engine_ids == processor_ids(vlm, messages, [data])
        if size == (48, 48):
            assert engine_ids.count(image_id) == 20
            assert len(engine_ids) == 55
