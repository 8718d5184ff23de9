"""The tiny fp32 Qwen3 model (built locally, cached) loaded with transformers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from tokcap.tiny import build_tiny_model

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return build_tiny_model(cache / "dense", kind="dense")


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    """A fresh fp32 copy of the tiny model in eval mode (no dropout), seeded."""
    import torch
    import transformers

    torch.manual_seed(0)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return loaded.eval()
