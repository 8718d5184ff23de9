"""Headless chromium for the report tests: a screenshot, or the DOM once the page's script ran."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["dump_dom", "run_chromium"]

_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
)  # fmt: skip


def run_chromium(profile: Path, *args: str) -> str:
    """Headless chromium with ``args`` and its own profile folder (offline); its output."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is missing: bash scripts/setup.sh --with-chromium installs it"
    command = [chromium, *_FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM after its script ran."""
    return run_chromium(profile, "--dump-dom", url)
