"""Faults in the sink (issue #9): TransferQueue's storage unit killed under a `TQSink`.

TQ runs on its own Ray, and one process cannot hold two (`local_tq` refuses), so the fault
runs in a subprocess (`tq_storage_kill.py`): stage rows, read them back, ``ray.kill`` the
storage actor, then ``get``/``put``/``clear`` again, each under a deadline. A dead storage
unit must surface as a typed `SinkError` (``MissingRows`` included), never as a hang or an
untyped exception, so the gate poisons the affected rollouts instead of stalling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("tq_storage_kill.py")
TYPED = ("SinkError:", "MissingRows:")


@pytest.fixture(scope="module")
def killed() -> dict[str, object]:
    env = dict(os.environ, RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--deadline-s", "5", "--ops", "get,put,clear"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines, done.stdout[-3000:]
    return json.loads(lines[-1])


def test_the_storage_unit_was_found_and_killed(killed: dict[str, object]) -> None:
    assert (killed["put"], killed["get_before"]) == ("ok", "ok")
    assert killed["killed"], killed["named_actors"]


@pytest.mark.parametrize("op", ["get_after", "put_after", "clear_after"])
def test_a_dead_storage_unit_is_a_typed_sink_error_not_a_hang(
    killed: dict[str, object], op: str
) -> None:
    assert str(killed[op]).startswith(TYPED), killed
