"""Loading the worked examples of a tokcap checkout (``examples/*.py``) as modules.

`tokcap demo` and `tokcap train` run `examples/custom_trainer.py` itself rather than a
copy of it, so the composition a trainer author copies is the one the demo exercises.
The examples live in the repository, not in the installed package: they are found next
to the working directory or next to this package's source checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["examples_dir", "load_example"]


def examples_dir() -> Path | None:
    """The checkout's ``examples/`` folder, or None when tokcap runs from an installed wheel."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "examples" / "custom_trainer.py").is_file():
            return base / "examples"
    return None


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (once) as module ``tokcap_examples.<name>``."""
    module_name = f"tokcap_examples.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = examples_dir()
    if folder is None:
        raise FileNotFoundError(
            f"examples/{name}.py not found: run tokcap demo / tokcap train from a tokcap checkout"
        )
    spec = importlib.util.spec_from_file_location(module_name, folder / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
