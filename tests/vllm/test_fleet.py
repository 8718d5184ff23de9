"""`GateFleet` over real gates' control planes, without engines.

Each gate is a real `Gate` behind its real `ControlPlane` (ASGI, over httpx); the only
stand-in is the transport that sends each URL to its gate, and that refuses connections
to a gate marked down (a dead gate; the e2e tests kill a real one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
import pytest

from tokcap_core import Receipt
from tokcap_vllm import (
    ControlConflict,
    ControlNotFound,
    Gate,
    GateConfig,
    GateFleet,
    RolloutClose,
)
from tokcap_vllm.errors import RolloutNotFound
from tokcap_vllm.extend import ControlPlane

TOKEN = "fleet-unit-token"
URLS = ["http://gate-a:8000", "http://gate-b:8000"]


class Hosts(httpx.AsyncBaseTransport):
    """Routes each request to its gate's control plane; a host in ``down`` refuses."""

    def __init__(self, gates: dict[str, Gate]) -> None:
        env = {"TOKCAP_CONTROL_TOKEN": TOKEN}
        self.apps = {
            url.removeprefix("http://"): httpx.ASGITransport(ControlPlane(gate, environ=env))
            for url, gate in gates.items()
        }
        self.down: set[str] = set()
        self.answer_lost: set[str] = set()
        """Hosts whose next request is served but whose answer never comes back."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        response = await self.apps[host].handle_async_request(request)
        if host in self.answer_lost:
            self.answer_lost.discard(host)
            await anyio.sleep_forever()
        return response


@dataclass(frozen=True, slots=True)
class Fleet:
    """Two real gates (``gates``, by URL) behind ``hosts``, and an open `GateFleet` on them."""

    fleet: GateFleet
    gates: dict[str, Gate]
    hosts: Hosts


@pytest.fixture
async def two() -> AsyncIterator[Fleet]:
    gates = {url: Gate(GateConfig(require_open=True)) for url in URLS}
    hosts = Hosts(gates)
    async with GateFleet(URLS, TOKEN, transport=hosts, backoff_s=0.0) as fleet:
        yield Fleet(fleet, gates, hosts)


async def _open_four(fleet: GateFleet, prefix: str) -> list[str]:
    """Open ``{prefix}0`` .. ``{prefix}3`` through the fleet: 0 and 2 on gate-a, 1 and 3 on
    gate-b (the least loaded gate, ties to the first)."""
    rids = [f"{prefix}{i}" for i in range(4)]
    for rid in rids:
        await fleet.open(rid)
    return rids


async def _close_and_fetch(
    fleet: GateFleet, rids: list[str], reward: float | None = None
) -> list[Receipt]:
    """Close each rollout through the fleet, then fetch its receipt against its head."""
    heads = {rid: await fleet.close(rid, reward=reward) for rid in rids}
    return await fleet.fetch_receipts(rids, expected_heads=heads)


@pytest.mark.anyio
async def test_rollouts_go_to_the_least_loaded_gate_and_stay_there(two: Fleet) -> None:
    fleet, gates = two.fleet, two.gates
    urls = [await fleet.open(f"r{i}") for i in range(4)]
    assert urls[0] == "http://gate-a:8000/tokcap/rollouts/r0/v1"
    assert [fleet.gate_url(f"r{i}") for i in range(4)] == [*URLS, *URLS]
    assert await fleet.open("r0") == urls[0]  # stable for the rollout's life
    await fleet.close("r0", reward=1.0)
    await fleet.open("r4")  # gate-a has one open rollout now, gate-b two
    assert fleet.gate_url("r4") == URLS[0]
    # opened there (where a captured call joins its rollout), and nowhere else
    assert gates[URLS[1]].book.join("r1", require_open=True) is not None
    with pytest.raises(RolloutNotFound):
        gates[URLS[0]].book.join("r1", require_open=True)
    with pytest.raises(ControlNotFound):
        fleet.base_url("never-opened")


@pytest.mark.anyio
async def test_an_open_cut_short_after_the_gate_opened_leaves_nothing_held(two: Fleet) -> None:
    fleet, gates, hosts = two.fleet, two.gates, two.hosts
    hosts.answer_lost.add("gate-a:8000")  # the gate opens it; its answer never arrives
    with anyio.move_on_after(0.5) as waited:
        await fleet.open("cut")
    assert waited.cancelled_caught
    # the fleet closed and released it there: no gate holds it, the fleet forgot it
    assert [g.book.states() for g in gates.values()] == [{}, {}]
    assert [r.open for r in fleet.report()] == [0, 0]
    with pytest.raises(ControlNotFound):
        fleet.gate_url("cut")
    assert await fleet.open("cut") == "http://gate-a:8000/tokcap/rollouts/cut/v1"  # anew


@pytest.mark.anyio
async def test_receipts_come_from_each_rollouts_own_gate(two: Fleet) -> None:
    fleet = two.fleet
    rids = await _open_four(fleet, "q")
    receipts = await _close_and_fetch(fleet, rids, reward=0.5)
    assert [r.rollout_id for r in receipts] == rids
    assert {r.failure_reason for r in receipts} == {"no_terminal"}  # opened, no calls
    for rid in rids:
        await fleet.release(rid)
    assert [(r.opened, r.closed, r.released) for r in fleet.report()] == [(2, 2, 2)] * 2


@pytest.mark.anyio
async def test_a_gate_that_stops_answering_poisons_only_its_open_rollouts(two: Fleet) -> None:
    fleet, hosts = two.fleet, two.hosts
    rids = await _open_four(fleet, "k")
    hosts.down.add("gate-b:8000")
    receipts = {r.rollout_id: r for r in await _close_and_fetch(fleet, rids)}
    assert receipts["k0"].failure_reason == receipts["k2"].failure_reason == "no_terminal"
    assert receipts["k1"].failure_reason == "gate_unreachable:ConnectError"
    assert receipts["k3"].failure_reason == "gate_unreachable:ConnectError"
    assert set(fleet.lost()) == {"k1", "k3"}
    assert fleet.orphaned_keys(["k1/c000001", "k0/c000001", "k3/c000002"]) == [
        "k1/c000001",
        "k3/c000002",
    ]
    a, b = fleet.report()
    assert (a.alive, a.unreachable, b.alive, b.unreachable) == (True, 0, False, 2)
    await fleet.open("k5")  # new rollouts go to the gates that answer
    assert fleet.gate_url("k5") == URLS[0]
    for rid in rids:
        await fleet.release(rid)
    assert fleet.lost() == {}


@pytest.mark.anyio
async def test_a_batch_close_goes_to_each_gate_once_and_a_dead_gate_loses_only_its_own(
    two: Fleet,
) -> None:
    fleet, hosts = two.fleet, two.hosts
    rids = await _open_four(fleet, "b")  # b0, b2 on gate-a; b1, b3 on gate-b
    hosts.down.add("gate-b:8000")
    closes = [RolloutClose(rollout_id=rid, reward=0.5) for rid in rids]
    results = await fleet.close_many(closes)
    assert [r.rollout_id for r in results] == rids
    assert all(r.ok for r in results)  # the lost ones get their genesis head
    assert set(fleet.lost()) == {"b1", "b3"}
    again = await fleet.close_many([RolloutClose(rollout_id="b0")])
    assert isinstance(again[0].error, ControlConflict)
    heads = {r.rollout_id: r.head_or_raise() for r in results}
    receipts = await fleet.fetch_receipts(rids, expected_heads=heads)
    assert [r.failure_reason for r in receipts] == [
        "no_terminal",
        "gate_unreachable:ConnectError",
    ] * 2
    await fleet.release_many(rids)
    a, b = fleet.report()
    assert (a.closed, a.released, b.unreachable) == (2, 2, 2)


@pytest.mark.anyio
async def test_a_probe_marks_a_gate_that_stopped_answering_lost_and_keeps_one_that_answers(
    two: Fleet,
) -> None:
    """What a trainer asks when a harness call to a gate failed in transport."""
    fleet, hosts = two.fleet, two.hosts
    for i in range(4):
        await fleet.open(f"p{i}")
    assert await fleet.probe(URLS[0] + "/")
    hosts.down.add("gate-b:8000")
    assert not await fleet.probe(URLS[1])
    assert fleet.lost() == {
        "p1": "gate_unreachable:ConnectError",
        "p3": "gate_unreachable:ConnectError",
    }
    hosts.down.clear()
    assert not await fleet.probe(URLS[1])  # a lost gate stays lost
    await fleet.open("p4")
    assert fleet.gate_url("p4") == URLS[0]
    assert [(r.alive, r.unreachable) for r in fleet.report()] == [(True, 0), (False, 2)]
    with pytest.raises(ValueError, match="not a gate of this fleet"):
        await fleet.probe("http://gate-c:8000")


@pytest.mark.anyio
async def test_a_batch_close_with_receipts_answers_what_fetch_receipts_would(
    two: Fleet,
) -> None:
    """Receipts from the close's own answer are the ones a separate fetch verifies, and a
    dead gate's rollouts get their ``gate_unreachable`` receipt in the same results."""
    fleet, hosts = two.fleet, two.hosts
    rids = await _open_four(fleet, "w")  # w0, w2 on gate-a; w1, w3 on gate-b
    hosts.down.add("gate-b:8000")
    closes = [RolloutClose(rollout_id=rid, reward=0.5) for rid in rids]
    results = await fleet.close_many(closes, receipts="terminal")
    heads = {r.rollout_id: r.head_or_raise() for r in results}
    fetched = await fleet.fetch_receipts(rids, expected_heads=heads)
    assert [r.receipt for r in results] == fetched
    assert [r.receipt.failure_reason for r in results if r.receipt is not None] == [
        "no_terminal",
        "gate_unreachable:ConnectError",
    ] * 2
    await fleet.release_many(rids)
