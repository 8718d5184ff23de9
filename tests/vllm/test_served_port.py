"""A served gate whose port was taken between being chosen and being bound starts again on
another (`tokcap.compose.ServedGate`, what ``tokcap train --gates N`` starts).

The race is caused for real: the port is chosen free, and this test listens on it while
the gate's process is still importing vLLM (seconds before it binds).
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.e2e._gates import ServedGate
from tests.vllm._helpers import CONTROL_TOKEN
from tokcap.compose import PORT_TRIES

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_gate_whose_chosen_port_was_taken_before_it_bound_starts_on_another(
    tiny_model: Path, tmp_path: Path
) -> None:
    log = tmp_path / "gate.log"
    gate = ServedGate(tiny_model, ["--tokcap-sink", "memory"], token=CONTROL_TOKEN, log=log)
    try:
        with socket.socket() as squatter:  # takes the chosen port before the gate binds it
            squatter.bind(("127.0.0.1", gate.port))
            squatter.listen()
            taken = gate.port
            gate.wait_healthy(CONTROL_TOKEN)
        assert gate.ports_tried == 2 <= PORT_TRIES
        assert gate.port != taken
        text = log.read_text(errors="replace")
        assert "Address already in use" in text
        assert f"[tokcap] port taken: started again on {gate.port}" in text
        health = httpx.get(
            f"{gate.url}/tokcap/v1/health", headers={"authorization": f"Bearer {CONTROL_TOKEN}"}
        )
        assert health.status_code == 200
    finally:
        gate.stop()


def test_a_port_the_caller_chose_is_never_swapped_for_another(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A taken port the caller named is its problem to see: the gate fails, with the log."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        gate = ServedGate(
            tiny_model, ["--tokcap-sink", "memory"], token=CONTROL_TOKEN, log=tmp_path / "g.log",
            port=port,
        )  # fmt: skip
        try:
            with pytest.raises(RuntimeError, match="Address already in use"):
                gate.wait_healthy(CONTROL_TOKEN)
            assert gate.ports_tried == 1
            assert gate.port == port
        finally:
            gate.stop()
