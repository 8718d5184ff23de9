"""Suite-wide pytest set-up.

transferqueue installs a stray top-level ``tests`` package into site-packages. Our test modules
import shared helpers as ``from tests.<helper> import ...``; pyproject's ``pythonpath = ["."]``
puts the repo root first on ``sys.path`` so that ``tests`` is this folder. Fail loudly if not.
"""

from __future__ import annotations

import os
from pathlib import Path

import tests

_HERE = Path(__file__).resolve().parent
if Path(tests.__file__).resolve().parent != _HERE:
    raise RuntimeError(
        f"`import tests` resolved to {tests.__file__}, not {_HERE}: run pytest from the repo "
        "root (bash scripts/test.sh) so the repo's tests/ package shadows site-packages."
    )

# Ray must not re-run `uv run` in its workers (see scripts/setup.sh).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
