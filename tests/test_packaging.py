"""Packaging and static checks: what CI must prove beyond behaviour.

- the core installs from its wheel alone into a clean environment (no torch, no
  msgspec, no adapter) and its golden vectors and CLI work there;
- every other package installs from its wheel with only what it declares (and what
  that brings), into a clean environment of its own, imports, and runs its CLI there;
  ``tokcap-vllm serve`` without vLLM says how to install it in one line; the trainer's room
  (`tokcap_vllm.client`) imports and runs there without vLLM, torch or the engine side;
- every workspace member builds a wheel;
- the packages are clean under ``mypy --strict`` and ``ruff check``.

Each package's third-party closure is installed the way the set-up installs it (``uv sync``
of the lock, for that package alone), whatever index filled the machine's uv cache; the
workspace members then come offline from the freshly built wheels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
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
    assert names == [
        "tokcap",
        "tokcap_core",
        "tokcap_ray",
        "tokcap_tq",
        "tokcap_trl",
        "tokcap_vllm",
    ]


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
    assert '"ok": true' in cli.stdout


def _members(uv: str, package: str) -> list[str]:
    """The workspace members in ``package``'s locked closure (it included), by folder name."""
    export = _run(
        uv, "export", "--package", package, "--frozen", "--no-hashes", "--no-default-groups",
        "--quiet",
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    members = []
    for line in export.stdout.splitlines():
        if line.startswith("-e "):  # a workspace member: "." or "./packages/<name>"
            path = line.removeprefix("-e ").split(";")[0].strip()
            members.append("tokcap" if path == "." else Path(path).name)
    assert package in members, export.stdout
    return members


def _install_alone(uv: str, wheels: Path, venv: Path, package: str) -> Path:
    """A fresh venv holding ``package`` and its locked closure, nothing else; its ``bin``.

    The third-party closure comes the way ``scripts/setup.sh`` gets it, ``uv sync`` of the
    lock (the package alone, no groups, no workspace member): uv fetches each wheel by the
    URL the lock records, from its cache when it holds it, so no index metadata is needed
    whatever index filled the cache. The members then come from the freshly built wheels,
    offline and without dependencies; ``uv pip check`` proves every installed
    distribution's requirements are met, the package's first.
    """
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    synced = subprocess.run(
        [uv, "sync", "--package", package, "--frozen", "--no-default-groups",
         "--no-install-workspace", "--python", sys.executable, "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert synced.returncode == 0, synced.stderr
    python = venv / "bin" / "python"
    built = [
        next(wheels.glob(f"{member.replace('-', '_')}-*.whl")) for member in _members(uv, package)
    ]
    installed = _run(
        uv, "pip", "install", "--quiet", "--offline", "--no-deps", "--python", python, *built
    )
    assert installed.returncode == 0, installed.stderr
    checked = _run(uv, "pip", "check", "--python", python)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return venv / "bin"


@dataclass(frozen=True)
class Alone:
    """What a package's clean venv must do: ``check`` prints ``expect``; ``absent`` are
    modules it must not have pulled in."""

    check: str
    expect: str
    absent: tuple[str, ...]


ALONE = {
    "tokcap-ray": Alone(
        "import tokcap_ray; print(tokcap_ray.PoolConfig(num_workers=2).scheduling_strategy)",
        "SPREAD",
        ("torch", "transfer_queue", "vllm", "sniffio"),
    ),
    "tokcap-tq": Alone(
        "import tokcap_tq; from tokcap_core.simulate import simulate_rollout;"
        "calls = simulate_rollout('alone', seed=1, routes=True).calls;"
        "print(tokcap_tq.decode_staged(tokcap_tq.encode_staged(calls)) == calls)",
        "True",
        ("vllm", "tokcap_ray", "tokcap_vllm"),
    ),
    "tokcap-vllm": Alone(
        "import tokcap_vllm; print(tokcap_vllm.GateConfig.__name__)",
        "GateConfig",
        ("vllm", "torch", "ray", "transfer_queue"),
    ),
    "tokcap-trl": Alone(
        "import sys, tokcap_trl; print(tokcap_trl.GRPORollouts.__name__, 'trl' in sys.modules)",
        "GRPORollouts False",
        ("vllm", "tokcap_ray", "tokcap"),
    ),
    "tokcap": Alone("import tokcap; print(tokcap.__name__)", "tokcap", ("vllm",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(ALONE))
def test_every_package_installs_alone_and_imports(
    uv: str, wheels: Path, tmp_path: Path, package: str
) -> None:
    bin_dir = _install_alone(uv, wheels, tmp_path / "venv", package)
    alone = ALONE[package]
    present = f"import importlib.util as u; print([m for m in {alone.absent!r} if u.find_spec(m)])"
    result = _run(bin_dir / "python", "-c", f"{alone.check}\n{present}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    *_, said, pulled_in = result.stdout.strip().splitlines()
    assert said == alone.expect, result.stdout
    assert pulled_in == "[]", f"{package} pulled in {pulled_in}"
    if package == "tokcap-vllm":
        _check_vllm_cli_without_vllm(bin_dir, tmp_path)
    if package == "tokcap":
        cli = _run(bin_dir / "tokcap", "--help", cwd=tmp_path)
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert "demo" in cli.stdout


TRAINER_ROOM_ALONE = """
import socket, sys
import anyio
import tokcap_vllm.client as client
from tokcap_vllm.errors import ControlPlaneError, WeightSyncError

sock = socket.socket()
sock.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
url = f"http://127.0.0.1:{sock.getsockname()[1]}"

async def main():
    async with client.ControlPlaneClient(url, "token", retries=0) as one:
        try:
            await one.health()
        except ControlPlaneError as e:
            print("ControlPlaneClient", type(e).__name__, e.code)
    async with client.GateFleet([url], "token", retries=0) as fleet:
        try:
            await fleet.open("r1")
        except ControlPlaneError as e:
            print("GateFleet", type(e).__name__, e.code)
    try:
        await client.wait_for_gates([url], "token", timeout_s=0.5, interval_s=0.1)
    except ControlPlaneError as e:
        print("wait_for_gates", type(e).__name__, e.code)
    async with client.GateWeightClient(url, "token") as weights:
        try:
            await weights.info()
        except WeightSyncError as e:
            print("GateWeightClient", type(e).__name__, e.code)

anyio.run(main)
engine_side = ("gate", "server", "control", "persist")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch")
             or (m.startswith("tokcap_vllm.") and m.split(".")[1] in engine_side)))
"""


def test_the_trainer_room_imports_and_runs_without_vllm_or_torch(
    uv: str, wheels: Path, tmp_path: Path
) -> None:
    """`tokcap_vllm.client`, in a clean environment holding tokcap-vllm and what it declares
    (no vLLM, no torch), imports without any engine-side room and its clients run: against
    a port nothing listens on each fails with its typed error."""
    bin_dir = _install_alone(uv, wheels, tmp_path / "venv", "tokcap-vllm")
    find = "import importlib.util as u; print([m for m in ('vllm', 'torch') if u.find_spec(m)])"
    present = _run(bin_dir / "python", "-c", find, cwd=tmp_path)
    assert present.stdout.strip() == "[]", present.stdout + present.stderr
    result = _run(bin_dir / "python", "-c", TRAINER_ROOM_ALONE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines() == [
        "ControlPlaneClient ControlUnreachable unreachable",
        "GateFleet ControlUnreachable unreachable",
        "wait_for_gates ControlUnreachable gates_not_ready",
        "GateWeightClient WeightSyncError info_failed",
        "[]",
    ]


def _check_vllm_cli_without_vllm(bin_dir: Path, cwd: Path) -> None:
    helped = _run(bin_dir / "tokcap-vllm", "--help", cwd=cwd)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: tokcap-vllm serve MODEL")
    served = _run(bin_dir / "tokcap-vllm", "serve", "some/model", cwd=cwd)
    assert served.returncode != 0
    assert served.stdout == ""
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr  # the install hint, not a traceback
    assert "pip install vllm" in lines[0]
    assert "Traceback" not in served.stderr


def test_packages_pass_mypy_strict() -> None:
    result = _run(
        sys.executable, "-m", "mypy", "--strict", "--no-incremental", *PACKAGES, "src", "examples"
    )
    assert result.returncode == 0, result.stdout[-4000:]


def test_packages_pass_ruff() -> None:
    paths = ("packages", "src", "bench", "tests", "examples")
    result = _run(sys.executable, "-m", "ruff", "check", *paths)
    assert result.returncode == 0, result.stdout[-4000:]
    formatted = _run(sys.executable, "-m", "ruff", "format", "--check", *paths)
    assert formatted.returncode == 0, formatted.stdout[-4000:]
