"""Before a push, a fleet run drops the gates that died (`tokcap.compose.drop_dead_gates`).

Engine-free: two real gates behind their real control planes (the transport that refuses a
dead gate's connections is tests/vllm/test_fleet.py's ``Hosts``; the e2e tests and the
manual ``tokcap train --async --gates 2`` run kill a real gate process). What an
``--async`` run needs: the gates keep serving during a push, and a push that fails on a gate
nobody knew was dead would hold the live ones too.
"""

from __future__ import annotations

import anyio
import pytest

from tests.vllm.test_fleet import TOKEN, URLS, Hosts
from tokcap.compose import SERVED_ENV, drop_dead_gates
from tokcap_core.reasons import GATE_UNREACHABLE, reason_bucket
from tokcap_vllm import Gate, GateConfig, GateFleet
from tokcap_vllm.weights import FleetWeightSync, WeightPushError


def test_a_dead_gate_is_dropped_from_the_push_and_its_open_rollouts_poisoned() -> None:
    hosts = Hosts({url: Gate(GateConfig(require_open=True)) for url in URLS})

    async def run() -> None:
        async with (
            GateFleet(URLS, TOKEN, transport=hosts, backoff_s=0.0) as fleet,
            FleetWeightSync([(url, TOKEN) for url in URLS]) as weights,
        ):
            for rid in ("r0", "r1", "r2"):  # r0, r2 on gate-a; r1 on gate-b
                await fleet.open(rid)
            assert await drop_dead_gates(fleet, weights) == []  # both answer: nothing dropped
            hosts.down.add("gate-b:8000")  # its process killed
            assert await drop_dead_gates(fleet, weights) == [URLS[1]]
            assert [c.base_url for c in weights.clients] == [URLS[0]]
            assert list(fleet.lost()) == ["r1"]
            assert reason_bucket(fleet.lost()["r1"]) == GATE_UNREACHABLE
            assert [r.alive for r in fleet.report()] == [True, False]
            assert await drop_dead_gates(fleet, weights) == []  # lost stays lost, once
            hosts.down.add("gate-a:8000")
            with pytest.raises(WeightPushError) as none_left:
                await drop_dead_gates(fleet, weights)
            assert none_left.value.code == "no_gates"

    anyio.run(run)


def test_served_gates_keep_idle_connections_longer_than_their_clients() -> None:
    """httpx (the control plane's client) and the openai client's httpx2 keep an idle
    connection 5 s; a gate that closes it at the same moment resets a request sent on it,
    and the trainer takes the gate for dead (seen in ``--async --gates 2`` runs)."""
    import httpx

    client_keepalive_s = httpx.Limits().keepalive_expiry
    assert client_keepalive_s is not None
    assert float(SERVED_ENV["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > 2 * client_keepalive_s
