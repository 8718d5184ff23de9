"""A tiny Idefics3 vision-language model built locally (no hub), for image capture tests.

Idefics3 is the family vLLM's CPU engine serves here without torchvision (transformers'
PIL image processor, ``Idefics3ImageProcessorPil``); Qwen2-VL-style families import
torchvision, which does not install beside the CPU torch. The model: a Llama text part of
the tiny layer shape (`TINY_LAYERS`, tied embeddings) on the tiny tokenizer plus Idefics3's
image tokens (vocabulary 2,088), a one-layer vision tower (hidden 32, 64-pixel tiles of
16-pixel patches) and a pixel-shuffle connector (``scale_factor`` 2: 4 ``<image>`` tokens
per tile). The processor resizes an image's longest edge to 128 and splits it into tiles of
64 plus a global view, so a square image becomes 2x2 tiles + 1 = 5 views, 34 prompt tokens
(20 of them ``<image>``). Weights are fp32 and seeded: two builds are byte-identical.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Final

from ._cache import (
    TINY_LAYERS,
    hash_recipe,
    library_versions,
    staging_dir,
    stamp_matches,
    write_stamp,
)
from ._engine import CHATML_TOOLS_IMAGES_TEMPLATE, ENGINE_ARGS, chatml_tool_args
from ._qwen import EOS_TOKEN, PAD_TOKEN, PROBES, _tokenizer_hash, tokenizer_or_built

__all__ = [
    "IMAGE_TOKEN",
    "VLM_CHAT_TEMPLATE",
    "VLM_IMAGE_TOKENS",
    "VLM_TOOLS_VLLM_ARGS",
    "VLM_VLLM_ARGS",
    "build_tiny_vlm",
]

RECIPE_VERSION: Final = 1
MODEL_SEED: Final = 0
IMAGE_TOKEN: Final = "<image>"
"""The placeholder a chat template writes for one image; the engine expands it."""
VLM_IMAGE_TOKENS: Final = (
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)
"""Idefics3's special tokens, added to the tiny tokenizer (40 of them)."""
VLM_CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{- '<image>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML whose content may be a list of parts: text as is, each image part one ``<image>``."""
_IMAGE_PROCESSOR: Final[dict[str, Any]] = {
    "size": {"longest_edge": 128},
    "max_image_size": {"longest_edge": 64},
    "do_image_splitting": True,
}
_VISION: Final[dict[str, Any]] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "image_size": 64,
    "patch_size": 16,
}
_SCALE_FACTOR: Final = 2
# (image_size / patch_size)^2 / scale_factor^2 placeholder tokens per tile
_IMAGE_SEQ_LEN: Final = (64 // 16) ** 2 // _SCALE_FACTOR**2

VLM_VLLM_ARGS: Final = (*ENGINE_ARGS, "--limit-mm-per-prompt", '{"image": 4}')
"""The tiny VLM's engine options: the CPU engine's, at most 4 images per prompt."""
VLM_TOOLS_VLLM_ARGS: Final = (*VLM_VLLM_ARGS, *chatml_tool_args(CHATML_TOOLS_IMAGES_TEMPLATE))
"""`VLM_VLLM_ARGS` with tool calls (``hermes`` parser, `CHATML_TOOLS_IMAGES_TEMPLATE`):
`tokcap demo --model-family idefics3`."""


def build_tiny_vlm(out_dir: Path, *, tokenizer_dir: Path | None = None) -> Path:
    """Build (or reuse) the tiny random-weight Idefics3 in ``out_dir``, processor included.

    The folder loads with ``transformers.AutoProcessor`` (tokenizer, PIL image processor,
    `VLM_CHAT_TEMPLATE`) and serves with vLLM (`VLM_VLLM_ARGS`). ``tokenizer_dir`` defaults
    to a tokenizer built by `build_tiny_tokenizer` in a temporary folder; the build fails
    unless the saved tokenizer gives that tokenizer's ids on every probe text.
    """
    out_dir = Path(out_dir)
    recipe = {
        "what": "vlm",
        "version": RECIPE_VERSION,
        "text": dict(TINY_LAYERS),
        "vision": _VISION,
        "scale_factor": _SCALE_FACTOR,
        "image_processor": _IMAGE_PROCESSOR,
        "added_tokens": list(VLM_IMAGE_TOKENS),
        "template": VLM_CHAT_TEMPLATE,
        "tokenizer": _tokenizer_hash(tokenizer_dir),
        "seed": MODEL_SEED,
        "versions": library_versions(),
    }
    recipe_hash = hash_recipe(recipe)
    if stamp_matches(out_dir, recipe_hash):
        return out_dir
    with (
        tokenizer_or_built(tokenizer_dir, "tokcap-vlm-tok-") as tok_dir,
        staging_dir(out_dir) as tmp,
    ):
        _save_vlm(tok_dir, tmp)
        write_stamp(tmp, recipe, recipe_hash)
    return out_dir


def _save_vlm(tok_dir: Path, out_dir: Path) -> None:
    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped library
    pil: Any = importlib.import_module("transformers.models.idefics3.image_processing_pil_idefics3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    trained = [tokenizer.encode(text, add_special_tokens=False) for text in PROBES]
    tokenizer.add_tokens(list(VLM_IMAGE_TOKENS), special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    processor = transformers.Idefics3Processor(
        image_processor=pil.Idefics3ImageProcessorPil(**_IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        image_seq_len=_IMAGE_SEQ_LEN,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    text = transformers.LlamaConfig(
        **TINY_LAYERS,
        vocab_size=len(tokenizer),
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    config = transformers.Idefics3Config(
        text_config=text.to_dict(),
        vision_config=_VISION,
        scale_factor=_SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=pad,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = transformers.Idefics3ForConditionalGeneration(config).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    _assert_reloads(out_dir, trained)


def _assert_reloads(folder: Path, trained: list[list[int]]) -> None:
    """Fail the build unless ``AutoProcessor`` on ``folder`` keeps the trained ids and the
    image tokens are single special tokens."""
    transformers: Any = importlib.import_module("transformers")  # untyped library
    tokenizer = transformers.AutoProcessor.from_pretrained(folder).tokenizer
    loaded = [tokenizer.encode(text, add_special_tokens=False) for text in PROBES]
    if loaded != trained:
        raise RuntimeError(f"{folder}: the saved tokenizer re-tokenises the probe texts")
    for token in VLM_IMAGE_TOKENS:
        if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
            raise RuntimeError(f"{folder}: {token} is not one token after reload")
