"""tokcap-core on every Python it claims (3.11 is the suite's own; 3.12 and 3.13 here).

For each interpreter: a fresh venv holding the core's wheel, pytest, pytest-timeout and
hypothesis, nothing else, runs ``tests/core`` against the installed wheel. Lean: the tests
marked ``slow`` (whole-kit sweeps the 3.11 run already makes) and the workspace smoke test
(it imports the adapters) are left out by name, and hypothesis runs its ``lean`` profile
(tests/conftest.py). A missing interpreter fails the test
with the way to install it: never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.12", "3.13")
TEST_TOOLS = ("pytest", "pytest-timeout", "hypothesis")


def find_python(version: str) -> Path | None:
    """An interpreter for ``version``: pyenv's, uv's managed one, or ``pythonX.Y`` on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(pyenv.glob(f"{version}.*/bin/python{version}"), reverse=True)
    uv = shutil.which("uv")
    if uv is not None:
        found = subprocess.run(
            [uv, "python", "find", "--python-preference", "only-managed", version],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if found.returncode == 0:
            candidates.append(Path(found.stdout.strip()))
    on_path = shutil.which(f"python{version}")
    if on_path is not None:
        candidates.append(Path(on_path))
    for candidate in candidates:
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def locked_version(name: str) -> str:
    """The version of ``name`` that uv.lock pins (the 3.11 suite runs the same)."""
    lock = (ROOT / "uv.lock").read_text()
    block = lock.split(f'[[package]]\nname = "{name}"\nversion = "', 1)[1]
    return block.split('"', 1)[0]


@pytest.fixture(scope="module")
def core_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    uv = shutil.which("uv")
    assert uv is not None, "uv must be on PATH (scripts/setup.sh installs it)"
    out = tmp_path_factory.mktemp("core-dist")
    built = subprocess.run(
        [uv, "build", "--package", "tokcap-core", "--wheel", "--quiet", "-o", out],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("tokcap_core-*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_the_core_passes_its_tests_on_every_supported_python(
    version: str, core_wheel: Path, tmp_path: Path
) -> None:
    python = find_python(version)
    assert python is not None, (
        f"Python {version} is missing: `uv python install {version}` (scripts/setup.sh does) "
        "or pyenv; tokcap-core claims it, so its tests must run on it"
    )
    uv = shutil.which("uv")
    assert uv is not None
    venv = tmp_path / f"py{version}"
    made = subprocess.run([uv, "venv", "--quiet", "--python", python, venv], check=False)
    assert made.returncode == 0
    pins = [f"{name}=={locked_version(name)}" for name in TEST_TOOLS]
    installed = subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", venv / "bin" / "python", core_wheel, *pins],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    run = subprocess.run(
        [venv / "bin" / "python", "-m", "pytest", "tests/core", "-q", "-x", "-m", "not slow",
         "--deselect", "tests/core/test_smoke_workspace.py", "--hypothesis-profile=lean"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"python{version}" in subprocess.run(
        [venv / "bin" / "python", "-c", "import tokcap_core, sys; print(tokcap_core.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
