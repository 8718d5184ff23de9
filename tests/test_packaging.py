"""Packaging and static checks: what CI must prove beyond behaviour.

- the core installs from its wheel alone into a clean environment (no torch, no
  msgspec, no adapter) and its golden vectors and CLI work there;
- every workspace member builds a wheel;
- the packages are clean under ``mypy --strict`` and ``ruff check``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(str(p) for p in (ROOT / "packages").glob("*/src"))


def _run(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def uv() -> str:
    path = shutil.which("uv")
    assert path is not None, "uv must be on PATH (scripts/setup.sh installs it)"
    return path


@pytest.fixture(scope="module")
def wheels(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = _run(uv, "build", "--all-packages", "--wheel", "--quiet", "-o", out)
    assert result.returncode == 0, result.stderr
    return out


def test_every_member_builds_a_wheel(wheels: Path) -> None:
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert names == ["tokcap", "tokcap_core", "tokcap_ray", "tokcap_tq", "tokcap_vllm"]


def test_core_wheel_works_alone_in_a_clean_environment(
    uv: str, wheels: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    assert _run(uv, "venv", "--quiet", "--python", sys.executable, venv).returncode == 0
    python = venv / "bin" / "python"
    (core_wheel,) = wheels.glob("tokcap_core-*.whl")
    installed = _run(uv, "pip", "install", "--quiet", "--python", python, "--no-deps", core_wheel)
    assert installed.returncode == 0, installed.stderr
    check = _run(
        python,
        "-c",
        "import importlib.util, tokcap_core.golden;"
        "n = tokcap_core.golden.assert_golden_vectors();"
        "heavy = ('torch', 'numpy', 'msgspec', 'attrs');"
        "absent = [m for m in heavy if importlib.util.find_spec(m)];"
        "print(n, absent)",
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr
    count, absent = check.stdout.split(" ", 1)
    assert int(count) > 0
    assert absent.strip() == "[]"
    cli = _run(venv / "bin" / "tokcap-core", "golden", cwd=tmp_path)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "OK" in cli.stdout


def test_packages_pass_mypy_strict() -> None:
    result = _run(sys.executable, "-m", "mypy", "--strict", "--no-incremental", *PACKAGES, "src")
    assert result.returncode == 0, result.stdout[-4000:]


def test_packages_pass_ruff() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", "packages", "src", "bench")
    assert result.returncode == 0, result.stdout[-4000:]
