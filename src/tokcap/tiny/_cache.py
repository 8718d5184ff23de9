"""Deterministic, cached builds of the tiny models: recipe stamps, staging, seeded saves.

A finished folder holds a ``tokcap-tiny.json`` stamp with the hash of its recipe; a later
build with the same recipe returns at once. A build happens in a sibling temporary folder
that is moved onto the target only when complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

__all__ = [
    "STAMP",
    "TINY_LAYERS",
    "hash_recipe",
    "library_versions",
    "read_stamp",
    "save_seeded_model",
    "staging_dir",
    "stamp_matches",
    "write_stamp",
]

STAMP = "tokcap-tiny.json"

TINY_LAYERS: Final[Mapping[str, Any]] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # CPU attention needs a head_dim of 32, 64, 80, ...
    "max_position_embeddings": 32768,
}
"""The layer shape every tiny family shares (each adds its own rope, tying, experts)."""


def library_versions() -> dict[str, str]:
    """The versions of the libraries a build depends on (part of every recipe)."""
    from importlib.metadata import version

    return {name: version(name) for name in ("tokenizers", "transformers", "torch")}


def hash_recipe(recipe: dict[str, Any]) -> str:
    """The hex sha256 of ``recipe`` as canonical JSON."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        stamp: dict[str, Any] = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp


def stamp_matches(folder: Path, recipe_hash: str) -> bool:
    stamp = read_stamp(folder)
    if stamp is None or stamp.get("recipe_hash") != recipe_hash:
        return False
    return all((folder / name).is_file() for name in stamp.get("files", ()))


def write_stamp(folder: Path, recipe: dict[str, Any], recipe_hash: str) -> None:
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    stamp = {
        "recipe_hash": recipe_hash,
        "recipe": recipe,
        "files": files,
        "python": sys.version.split()[0],
    }
    (folder / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


class staging_dir:
    """Build in a sibling temporary folder, then move it onto ``out_dir`` (never half-written).

    An existing ``out_dir`` is replaced only if it is empty or holds a stale tokcap stamp.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        if (
            self.out_dir.exists()
            and any(self.out_dir.iterdir())
            and read_stamp(self.out_dir) is None
        ):
            raise FileExistsError(
                f"{self.out_dir} exists and is not a tokcap tiny build; refusing to replace it"
            )
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}-", dir=self.out_dir.parent))
        return self.tmp

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.tmp.chmod(0o755)  # mkdtemp makes it private; engines may run as another user
        self.tmp.rename(self.out_dir)


def save_seeded_model(config: Any, out_dir: Path, *, seed: int, **generation: int | None) -> None:
    """A random fp32 causal LM of ``config`` (weights seeded with ``seed``) saved in
    ``out_dir``, with a generation config of ``generation`` (progress bars off meanwhile)."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(**generation)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
