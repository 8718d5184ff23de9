"""Tiny Mistral-family models next to the real tokenizers ``mistral_common`` ships (no hub).

A random-weight ``MistralForCausalLM`` (hidden 64, 2 layers, head_dim 32, fp32, seeded)
whose vocabulary matches one of the tokenizer files in ``mistral_common``'s package data,
copied into the model folder under the name vLLM's ``--tokenizer-mode mistral`` looks for:
- ``"tekken"``: ``tekken_240911.json`` (Tekken, instruct v3, vocab 131,072) as ``tekken.json``;
- ``"spm"``: ``mistral_instruct_tokenizer_240323.model.v3`` (SentencePiece, instruct v3,
  vocab 32,768) as ``tokenizer.model.v3``.
Served the way Mistral's model cards ask (`mistral_vllm_args`), these exercise the gate's
id-level planner (`tokcap_vllm.gate._planning._render_ids`) and Mistral's tool-call format.

Builds are deterministic and cached like `tokcap.tiny.build_tiny_model`: a finished folder
holds a stamp with the hash of its recipe (tokenizer file digest included), and a later call
with the same recipe returns at once.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

from ._cache import (
    TINY_LAYERS,
    hash_recipe,
    library_versions,
    save_seeded_model,
    staging_dir,
    stamp_matches,
    write_stamp,
)

__all__ = [
    "MISTRAL_TOKENIZERS",
    "MistralTokenizerKind",
    "build_tiny_mistral",
    "force_tool_calls",
    "mistral_vllm_args",
    "tiny_mistral",
    "tool_calls_token_id",
]

MistralTokenizerKind = Literal["tekken", "spm"]
"""Which ``mistral_common`` tokenizer a tiny Mistral model ships: Tekken or SentencePiece v3."""
MISTRAL_TOKENIZERS: Final[dict[str, tuple[str, str]]] = {
    "tekken": ("tekken_240911.json", "tekken.json"),
    "spm": ("mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3"),
}
"""Tokenizer kind → (file in ``mistral_common/data``, name in the model folder)."""
RECIPE_VERSION: Final = 1
MODEL_SEED: Final = 0


def mistral_vllm_args(*, tools: bool = True) -> list[str]:
    """The vLLM options Mistral's model cards ask for (tool calls: the ``mistral`` parser)."""
    args = ["--tokenizer-mode", "mistral"]
    if tools:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"]
    return args


def tiny_mistral(
    cache_dir: Path, *, tokenizer: MistralTokenizerKind = "tekken"
) -> tuple[Path, list[str]]:
    """``(model folder, vLLM options)``: a tiny Mistral model built (or reused) under
    ``cache_dir`` and the options that serve it as Mistral's model cards ask (what a demo's
    ``--model-family mistral`` needs)."""
    model = build_tiny_mistral(Path(cache_dir) / f"mistral-{tokenizer}", tokenizer=tokenizer)
    return model, mistral_vllm_args()


def tool_calls_token_id(model_dir: Path) -> int:
    """The id of the ``[TOOL_CALLS]`` control token of the tokenizer in ``model_dir``."""
    from mistral_common.tokens.tokenizers.base import SpecialTokens

    for _, target in MISTRAL_TOKENIZERS.values():
        if (Path(model_dir) / target).is_file():
            inner = _load(Path(model_dir) / target).instruct_tokenizer.tokenizer
            return int(inner.get_special_token(SpecialTokens.tool_calls.value))
    raise FileNotFoundError(f"{model_dir} holds no Mistral tokenizer file")


def force_tool_calls(
    model_dir: Path, arguments: Mapping[str, str], *, calls: int = 1
) -> dict[str, Any]:
    """``extra_body`` fields that make a tiny random Mistral model call tools, in Mistral's format.

    The output becomes ``[TOOL_CALLS]`` + a JSON array of ``calls`` objects
    ``{"name": N, "arguments": A}`` (``A`` matching the regex ``arguments[N]``, a JSON
    object) + ``</s>``, which vLLM's ``mistral`` tool parser turns into ``tool_calls``.
    How: a regex for vLLM's structured outputs (xgrammar, which runs on CPU; vLLM declares
    no special tokens to it for Mistral tokenizers, so ``[TOOL_CALLS]`` in the regex may
    match the control token) and a ``logit_bias`` of 100 on that control token, so the
    model takes it rather than spelling the text out. Send with ``tools`` and the default
    ``tool_choice`` (``"auto"``): ``"required"`` makes vLLM emit a bare JSON array instead.
    """
    if calls < 1 or not arguments:
        raise ValueError("force at least one call of at least one tool")
    one = (
        "("
        + "|".join(
            r'\{"name": "' + re.escape(name) + r'", "arguments": ' + args + r"\}"
            for name, args in sorted(arguments.items())
        )
        + ")"
    )
    return {
        "structured_outputs": {"regex": r"\[TOOL_CALLS\]\[" + ", ".join([one] * calls) + r"\]"},
        "logit_bias": {str(tool_calls_token_id(model_dir)): 100},
    }


def build_tiny_mistral(out_dir: Path, *, tokenizer: MistralTokenizerKind = "tekken") -> Path:
    """Build (or reuse) a tiny random ``MistralForCausalLM`` with a shipped Mistral tokenizer.

    The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and
    the tokenizer file (see the module docstring); serve it with `mistral_vllm_args`.
    """
    if tokenizer not in MISTRAL_TOKENIZERS:
        raise ValueError(
            f"tokenizer must be one of {sorted(MISTRAL_TOKENIZERS)}, not {tokenizer!r}"
        )
    out_dir = Path(out_dir)
    source, target = MISTRAL_TOKENIZERS[tokenizer]
    tok_file = _mistral_data() / source
    recipe = {
        "what": "mistral-model",
        "version": RECIPE_VERSION,
        "tokenizer": {"file": source, "sha256": _file_digest(tok_file)},
        "config": _config_args(),
        "seed": MODEL_SEED,
        "versions": {**library_versions(), "mistral_common": _version("mistral_common")},
    }
    recipe_hash = hash_recipe(recipe)
    if stamp_matches(out_dir, recipe_hash):
        return out_dir
    with staging_dir(out_dir) as tmp:
        shutil.copy2(tok_file, tmp / target)
        special = _special_ids(tmp / target)
        _save_random_model(tmp, special)
        write_stamp(tmp, recipe, recipe_hash)
    return out_dir


def _mistral_data() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(tokenizer_file: Path) -> Any:
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(tokenizer_file))


def _special_ids(tokenizer_file: Path) -> dict[str, int]:
    """Vocabulary size and bos/eos/pad ids, as ``mistral_common`` loads the tokenizer."""
    inner = _load(tokenizer_file).instruct_tokenizer.tokenizer
    return {
        "vocab_size": inner.n_words,
        "bos_token_id": inner.bos_id,
        "eos_token_id": inner.eos_id,
        "pad_token_id": inner.pad_id if inner.pad_id >= 0 else inner.eos_id,
    }


def _config_args() -> dict[str, Any]:
    """Architecture settings; vocabulary and special ids come from the tokenizer file."""
    return {
        **TINY_LAYERS,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }


def _save_random_model(out_dir: Path, special: dict[str, int]) -> None:
    import transformers

    args: dict[str, Any] = {**_config_args(), **special}
    save_seeded_model(
        transformers.MistralConfig(**args),
        out_dir,
        seed=MODEL_SEED,
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
    )
