"""Load a benchmark script (``bench/<name>.py``) as a module: benches are scripts, not a
package, so tests load them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_bench"]

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py``, executed as the module ``name`` and registered under it in
    ``sys.modules`` (dataclasses look their module up by name; scripts import each other by
    bare name); unregistered again if executing it fails."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
