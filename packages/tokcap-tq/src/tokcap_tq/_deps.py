"""Heavy dependencies, imported once with an install hint if they are missing."""

from __future__ import annotations

try:
    import numpy as np
    import ray
    import tensordict
    import torch
    import transfer_queue as tq  # type: ignore[import-untyped]
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"tokcap_tq needs TransferQueue, ray, torch and tensordict ({e.name} is missing): "
        'pip install "tokcap-tq"'
    ) from e

__all__ = ["np", "ray", "tensordict", "torch", "tq"]
