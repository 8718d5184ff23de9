"""The README's "Deploying on your own cluster" commands, run as written on loopback.

The block is read from README.md and run by bash; only the model (the tiny local one),
vLLM's fast-start options and the ports are replaced, and ``ray stop`` left out (the head
is stopped by its temp dir instead: ``ray stop`` would stop every Ray on the machine). Ray
stays on loopback through the environment (see `tokcap_tq.local_tq`), and keeps its files
in this test's folder.
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
from pathlib import Path

import pytest

from tests.e2e._gates import ENGINE_ENV, VLLM_ARGS, free_port
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


def test_the_readme_commands_train_through_two_served_gates(tmp_path: Path) -> None:
    from tokcap.tiny import build_tiny_model

    model = build_tiny_model(
        Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense", kind="dense"
    )
    script = readme_commands()
    for line, replaced in (
        ("MODEL=Qwen/Qwen3-0.6B", f"MODEL={model}"),
        ('VLLM_ARGS="--max-model-len 4096"', f'VLLM_ARGS="{" ".join(VLLM_ARGS)}"'),
        # `ray stop` stops every Ray on the machine (other tests' too): the head is stopped
        # below, by its temp dir
        ("\nray stop\n", "\n"),
    ):
        assert line in script
        script = script.replace(line, replaced)
    for port in ("6379", "8001", "8002"):
        assert port in script
        script = script.replace(port, str(free_port()))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    ray_dir = tempfile.mkdtemp(prefix="tokcap-rd-", dir="/tmp")
    env = {
        **os.environ,
        **ENGINE_ENV,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": ray_dir,
        "TQ_NUM_THREADS": "2",
        # A raylet gives up when its metrics agent is slow to start (seen on a loaded box).
        "RAY_agent_register_timeout_ms": "120000",
    }
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
        output, _ = run.communicate(timeout=1200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # whatever the script left behind
        _kill_leftovers(Path(ray_dir))  # Ray's own processes name their temp dir
        shutil.rmtree(ray_dir, ignore_errors=True)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("gate-*.log"))
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no summary:\n{output[-4000:]}\n{logs}"
    summary = json.loads(lines[-1])
    assert summary["rollouts"] == 8
    assert summary["verified"] == 8
    assert summary["rows_equal_engine_ids"] == 8
    assert [g["opened"] for g in summary["gates"]] == [4, 4]
    assert [g["released"] for g in summary["gates"]] == [4, 4]
