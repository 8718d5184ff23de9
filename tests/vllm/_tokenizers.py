"""Real tokenizers for the engine-free planning tests, built or copied locally (no engine, no hub).

- `chatml_tokenizer`: the tiny byte-level BPE of `tokcap.tiny` (ChatML specials,
  ``<|im_end|>`` its eos), loaded with transformers as vLLM loads it;
- `mistral_tokenizer`: vLLM's own ``MistralTokenizer`` over one of the tokenizer files
  ``mistral_common`` ships (`MISTRAL_FILES`).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any, Final

__all__ = ["MISTRAL_FILES", "chatml_tokenizer", "mistral_tokenizer"]

MISTRAL_FILES: Final = {
    "tekken": ("tekken_240911.json", "tekken.json"),
    "spm": ("mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3"),
    "v1": ("tokenizer.model.v1", "tokenizer.model.v1"),
}
"""A name → (file in ``mistral_common/data``, the name vLLM looks for in a model folder)."""


def _cache() -> Path:
    return Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))


@functools.cache
def chatml_tokenizer() -> Any:
    """The tiny ChatML tokenizer (built once into the tiny cache, then reloaded)."""
    from transformers import AutoTokenizer

    from tokcap.tiny import build_tiny_tokenizer

    return AutoTokenizer.from_pretrained(build_tiny_tokenizer(_cache() / "tokenizer"))


@functools.cache
def mistral_tokenizer(kind: str) -> Any:
    """vLLM's ``MistralTokenizer`` over the shipped tokenizer file named ``kind``."""
    import mistral_common
    from vllm.tokenizers.mistral import MistralTokenizer

    source, target = MISTRAL_FILES[kind]
    folder = _cache() / f"mistral-tokenizer-{kind}"
    if not (folder / target).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(mistral_common.__file__).parent / "data" / source, folder / target)
    return MistralTokenizer.from_pretrained(str(folder))
