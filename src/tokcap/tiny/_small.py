"""A ~100M-parameter random Qwen3 with the tiny tokenizer: the tiny model's family at a size
where the model's own work per token is like a small real model's (for benchmarks, no hub).

Same family, tokenizer and chat template as `tokcap.tiny.build_tiny_model` (dense Qwen3,
fp32, tied embeddings, seeded weights); only the shape differs (`SMALL_SHAPE`: hidden 768,
16 layers, 12 heads of 64 with 4 KV heads, MLP 2048, the shape of ``bench/bench_push.py``'s
~100M model). About 400 MB on disk. Builds are deterministic and cached like the tiny ones:
a finished folder holds a stamp with the hash of its recipe.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Final

from ._cache import library_versions, save_seeded_model
from ._qwen import EOS_TOKEN, PAD_TOKEN, _tokenizer_hash, build_beside_tokenizer

__all__ = ["SMALL_SHAPE", "build_small_model", "parameter_count"]

SMALL_SHAPE: Final[dict[str, Any]] = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
"""The architecture; vocabulary and special ids come from the tokenizer."""
RECIPE_VERSION: Final = 1
MODEL_SEED: Final = 0


def build_small_model(out_dir: Path, *, tokenizer_dir: Path | None = None) -> Path:
    """Build (or reuse) the ~100M random Qwen3 in ``out_dir``, tokenizer files included.

    ``tokenizer_dir`` defaults to a tokenizer built by `build_tiny_tokenizer` in a
    temporary folder (the same recipe, so the same tokenizer as the tiny models').
    """
    recipe = {
        "what": "small-model",
        "version": RECIPE_VERSION,
        "config": SMALL_SHAPE,
        "tokenizer": _tokenizer_hash(tokenizer_dir),
        "seed": MODEL_SEED,
        "versions": library_versions(),
    }
    return build_beside_tokenizer(
        Path(out_dir), recipe, tokenizer_dir, _save_random_model, prefix="tokcap-small-tok-"
    )


def parameter_count(model_dir: Path) -> int:
    """Parameters of the model in ``model_dir`` (tied weights counted once), from its config."""
    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped library
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _save_random_model(tok_dir: Path, out_dir: Path) -> None:
    transformers: Any = importlib.import_module("transformers")  # untyped library
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = transformers.Qwen3Config(
        **SMALL_SHAPE,
        vocab_size=len(tokenizer),
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    save_seeded_model(config, out_dir, seed=MODEL_SEED, eos_token_id=eos, pad_token_id=pad)
