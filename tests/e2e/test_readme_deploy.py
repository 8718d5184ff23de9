"""The README's "Deploying on your own cluster" commands, run as written on loopback.

The block is read from README.md and run by bash in a folder holding links to the
repository's ``examples`` and ``.venv`` (what the block's ``source .venv/bin/activate``
and ``python examples/...`` name); only the model (the tiny local one) and vLLM's
fast-start options are replaced. The block itself takes free ports, starts its own Ray head
in its own temp dir and process group and stops only that head (never ``ray stop``), so it
runs beside other Ray clusters on the host; nothing of that head may be left running. It
runs the trainer twice against the same gates (gates outlive trainers). Ray stays on
loopback through the block's own export (see `tokcap_tq.local_tq`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e._gates import ENGINE_ENV, VLLM_ARGS
from tokcap_tq._cluster import _kill_leftovers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> str:
    """The shell block under the README's "Deploying on your own cluster" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Deploying on your own cluster", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert match is not None
    return match.group(1)


def test_the_readme_commands_train_twice_through_two_served_gates(tmp_path: Path) -> None:
    from tokcap.tiny import build_tiny_model

    model = build_tiny_model(
        Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense", kind="dense"
    )
    script = readme_commands()
    for line, replaced in (
        ("MODEL=Qwen/Qwen3-0.6B", f"MODEL={model}"),
        (
            'VLLM_ARGS="--max-model-len 4096 --gpu-memory-utilization 0.4"',
            f'VLLM_ARGS="{" ".join(VLLM_ARGS)}"',
        ),
    ):
        assert line in script
        script = script.replace(line, replaced)
    assert "ray stop" not in script.replace("`ray stop`", "")  # every Ray on the host
    assert "6379" not in script  # fixed ports collide on a shared host
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    ray_dir = tempfile.mkdtemp(prefix="trd", dir="/tmp")  # short: Ray's sockets live below
    env = {
        **os.environ,
        **ENGINE_ENV,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": ray_dir,
        "TMPDIR": ray_dir,  # the block's `mktemp -d` (its head's folder) lands in ours
        "TQ_NUM_THREADS": "2",
        # A raylet gives up when its metrics agent is slow to start (seen on a loaded box).
        "RAY_agent_register_timeout_ms": "120000",
    }
    env.pop("VIRTUAL_ENV", None)
    # Ray on loopback comes from the block's own export (Ray binds the outward address
    # even with --node-ip-address 127.0.0.1 otherwise), not from this test.
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    assert "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in script
    run = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = run.communicate(timeout=1500)
        left = _left_after(Path(ray_dir), seconds=60)  # the block stops its own head
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # whatever the script left behind
        _kill_leftovers(Path(ray_dir))  # Ray's own processes name their temp dir
        ray_logs = _ray_log_tails(Path(ray_dir))  # why a head died, if it did
        shutil.rmtree(ray_dir, ignore_errors=True)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("gate-*.log"))
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == 2, f"two summaries expected:\n{output[-4000:]}\n{logs}\n{ray_logs}"
    assert len(list((tmp_path / "ledgers").glob("gate-*.ledger"))) == 2  # one file per gate
    for line in lines:
        summary = json.loads(line)
        assert summary["rollouts"] == 8
        assert summary["verified"] == 8
        assert summary["rows_equal_engine_ids"] == 8
        assert [g["opened"] for g in summary["gates"]] == [4, 4]
        assert [g["released"] for g in summary["gates"]] == [4, 4]
    assert left == [], f"the block left its Ray head's processes running: {left}"


def _ray_log_tails(folder: Path) -> str:
    """The last lines of the head's raylet and GCS logs under ``folder``."""
    tails = []
    for pattern in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):
        for log in folder.glob(f"**/session_latest/logs/{pattern}"):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {log.name}\n" + "\n".join(lines))
    return "\n".join(tails)


def _left_after(folder: Path, *, seconds: float) -> list[str]:
    """What still names ``folder`` once ``seconds`` have passed or nothing does.

    A `kill -9`ed raylet stays listed while the kernel tears down its object store's
    memory (seen once on a loaded CI box, right after the block's last line); a process that
    outlives a minute after SIGKILL was not killed.
    """
    deadline = time.monotonic() + seconds
    while (left := _naming(folder)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _naming(folder: Path) -> list[str]:
    """The command lines of live processes that name ``folder`` (Ray's name their temp dir)."""
    marker = str(folder).encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (line := (entry / "cmdline").read_bytes()):
                found.append(line.replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            continue
    return found
