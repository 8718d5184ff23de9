"""The ``tokcap`` command as a user runs it (``python -m tokcap ...``), for the e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "cli_env", "tokcap", "tokcap_command"]

REPO = Path(__file__).resolve().parents[2]


def cli_env() -> dict[str, str]:
    """This environment, with Ray's uv hook off and a fixed terminal width."""
    return {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "COLUMNS": "120"}


def tokcap_command(*args: str | Path) -> list[str]:
    """``python -m tokcap ARGS``."""
    return [sys.executable, "-m", "tokcap", *map(str, args)]


def tokcap(
    *args: str | Path, timeout: float, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``tokcap ARGS`` from the repository root; its output captured as text."""
    return subprocess.run(
        tokcap_command(*args),
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=timeout, check=check,
    )  # fmt: skip
