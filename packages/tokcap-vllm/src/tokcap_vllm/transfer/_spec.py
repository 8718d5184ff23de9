"""The set of tensors a push must carry, read from the checkpoint the engine loaded.

The engine's own modules cannot say it: vLLM fuses projections under other names
(``qkv_proj``), and on CPU it packs every linear into a oneDNN handle and empties
``.weight``. The checkpoint's safetensors headers can (a JSON header behind an 8-byte
length; no tensor is read). Two adjustments make it the push's contract:

- a floating tensor is expected in the engine's dtype (``--dtype``): vLLM's loaders would
  silently cast anything else, and parity with the trainer would be lost unnoticed;
- with tied embeddings, ``lm_head.weight`` is expected too, shaped like the embedding,
  though transformers leaves it out of the file: CPU vLLM keeps a packed copy of the head,
  which goes stale if only the embedding is pushed (4.9 nats off, measured).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "SAFETENSORS_DTYPES",
    "TensorSpec",
    "engine_spec",
    "expected_spec",
    "read_checkpoint_spec",
]

TensorSpec = tuple[str, tuple[int, ...]]
"""(torch dtype name without ``torch.``, shape)."""

SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})
_MAX_HEADER = 100 * 1024 * 1024


def read_checkpoint_spec(folder: str | Path) -> dict[str, TensorSpec]:
    """Every tensor in ``folder``'s ``*.safetensors`` files: name -> (dtype, shape).

    Raises `FileNotFoundError` without a safetensors file, `ValueError` on a malformed
    header, an unknown dtype or a name in two files.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    spec: dict[str, TensorSpec] = {}
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"{path.name}: a {size}-byte header is not a safetensors header")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in spec:
                raise ValueError(f"{name} is in two checkpoint files")
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path.name}: {name} has unsupported dtype {entry['dtype']!r}")
            spec[name] = (dtype, tuple(int(n) for n in entry["shape"]))
    return spec


def expected_spec(
    checkpoint: Mapping[str, TensorSpec],
    *,
    dtype: str,
    tie_word_embeddings: bool,
    embedding: str | None = None,
    head: str = "lm_head.weight",
) -> tuple[dict[str, TensorSpec], tuple[tuple[str, str], ...]]:
    """What a full push carries (floating tensors in ``dtype``, the tied head included), and
    the ``(head, embedding)`` pairs that must hold equal values (the engine has one tensor).
    ``embedding`` (None) is ``model.embed_tokens.weight``, else the checkpoint's one tensor
    named ``*.embed_tokens.weight`` (a vision-language model's text model:
    ``model.text_model.embed_tokens.weight``)."""
    spec = {
        name: (dtype if kind in FLOATING else kind, shape)
        for name, (kind, shape) in checkpoint.items()
    }
    if embedding is None:
        embedding = _embedding_of(spec)
    if not (tie_word_embeddings and embedding in spec):
        return spec, ()
    spec.setdefault(head, spec[embedding])
    return spec, ((head, embedding),)


def _embedding_of(spec: Mapping[str, TensorSpec]) -> str:
    default = "model.embed_tokens.weight"
    if default in spec:
        return default
    nested = [name for name in spec if name.endswith(".embed_tokens.weight")]
    return nested[0] if len(nested) == 1 else default


def engine_spec(model_config: Any) -> tuple[dict[str, TensorSpec], tuple[tuple[str, str], ...]]:
    """The push contract of an engine from its vLLM ``ModelConfig``: `expected_spec` of the
    checkpoint it loaded, in its dtype (readable in the API server and in every worker)."""
    return expected_spec(
        read_checkpoint_spec(_checkpoint_folder(model_config)),
        dtype=str(model_config.dtype).removeprefix("torch."),
        tie_word_embeddings=bool(
            getattr(model_config.hf_text_config, "tie_word_embeddings", False)
        ),
    )


def _checkpoint_folder(config: Any) -> str:
    """The local folder of the engine's checkpoint (a hub id resolves in the local cache)."""
    if Path(config.model).is_dir():
        return str(config.model)
    from huggingface_hub import snapshot_download

    folder: str = snapshot_download(
        config.model,
        revision=config.revision,
        local_files_only=True,
        allow_patterns=["*.safetensors", "*.json"],
    )
    return folder
