"""Issue #33's fleet breaks without engines: real `Gate`s behind their real `ControlPlane`
(ASGI over httpx, as in test_fleet.py) sharing one real `MemorySink`, as gates share a
TransferQueue partition; the only stand-in is the transport that maps each URL to its gate
(and `Hosts.restart` puts a new gate process's `Gate` behind a URL: a restart on its port).

- B4: concurrent `GateFleet.open` of one id open it on one gate;
- Q1: rollouts belong to the fleet that opened them (owner token and its lease);
- B5: a gate restarted on its port: ``gate_restarted``, its rows findable, no poisoned reuse;
- B6: one ledger file, one gate; Q8: an oversized batch close is 413; Q5: a Messages
  call's ``structured_outputs`` is bounded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tokcap_core import MemorySink
from tokcap_core.ids import StagingKey
from tokcap_core.simulate import simulate_rollout
from tokcap_vllm import (
    ControlConflict,
    ControlPlaneClient,
    Gate,
    GateConfig,
    GateFleet,
    RolloutClose,
)
from tokcap_vllm.errors import LedgerFileError, RolloutConflict, TooLarge
from tokcap_vllm.extend import ControlPlane
from tokcap_vllm.gate._rollouts import Owners
from tokcap_vllm.persist import LedgerFile

TOKEN = "hostile3-token"
URLS = ["http://gate-a:8000", "http://gate-b:8000"]
ENV = {"TOKCAP_CONTROL_TOKEN": TOKEN}


class Hosts(httpx.AsyncBaseTransport):
    """Each URL's requests go to its gate's control plane."""

    def __init__(self, gates: dict[str, Gate]) -> None:
        self.gates: dict[str, Gate] = {}
        self.apps: dict[str, httpx.ASGITransport] = {}
        for url, gate in gates.items():
            self.restart(url, gate)

    def restart(self, url: str, gate: Gate) -> None:
        """``gate`` now answers at ``url`` (a new process on the same port)."""
        self.gates[url] = gate
        self.apps[url] = httpx.ASGITransport(ControlPlane(gate, environ=ENV))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0)  # concurrent requests interleave, as over sockets
        app = self.apps[f"http://{request.url.host}:{request.url.port}"]
        return await app.handle_async_request(request)


@pytest.fixture
def sink() -> MemorySink:
    return MemorySink()


@pytest.fixture
def hosts(sink: MemorySink) -> Hosts:
    return Hosts({url: Gate(GateConfig(require_open=True), sink=sink) for url in URLS})


def _fleet(hosts: Hosts, **options: Any) -> GateFleet:
    return GateFleet(URLS, TOKEN, transport=hosts, backoff_s=0.0, **options)


def _client(hosts: Hosts, url: str, owner: str | None) -> ControlPlaneClient:
    return ControlPlaneClient(url, TOKEN, transport=hosts, backoff_s=0.0, owner=owner)


# ---- B4 ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_b4_concurrent_opens_of_one_id_open_it_on_one_gate(hosts: Hosts) -> None:
    async with _fleet(hosts) as fleet:
        urls: list[str] = []

        async def open_it() -> None:
            urls.append(await fleet.open("b4-r"))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(open_it)
        assert len(urls) == 4
        assert len(set(urls)) == 1
        held = [url for url, gate in hosts.gates.items() if "b4-r" in gate.rollouts()]
        assert held == [fleet.gate_url("b4-r")]
        assert sum(r.opened for r in fleet.report()) == 1


# ---- Q1 ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_q1_a_second_trainer_can_neither_open_close_nor_release_a_live_fleets_rollout(
    hosts: Hosts,
) -> None:
    async with _fleet(hosts, owner="trainer-a") as a, _fleet(hosts, owner="trainer-b") as b:
        await a.open("q1-r0")
        url = a.gate_url("q1-r0")
        assert url == URLS[0]
        with pytest.raises(ControlConflict) as refused:
            await b.open("q1-r0")  # b's least loaded gate is the same: refused there
        assert refused.value.code == "rollout_owned"
        for owner in ("trainer-b", None):  # another owner, or none, as a reclaim asks
            async with _client(hosts, url, owner) as other:
                (item,) = await other.rollouts()
                assert (item.rollout_id, item.owner) == ("q1-r0", "trainer-a")
                for attempt in (other.close("q1-r0", reward=0.0), other.release("q1-r0")):
                    with pytest.raises(ControlConflict) as refused:
                        await attempt
                    assert refused.value.code == "rollout_owned"
        assert hosts.gates[url].rollouts() == {"q1-r0": "open"}
        (closed,) = await a.close_many([RolloutClose(rollout_id="q1-r0", reward=1.0)])
        assert closed.ok
        async with _client(hosts, url, "trainer-b") as other:
            with pytest.raises(ControlConflict):
                await other.release("q1-r0")  # closed, still a's until a releases it
        await a.release("q1-r0")
        assert hosts.gates[url].rollouts() == {}
        await b.open("q1-r0")  # released: the id is free again


def test_q1_an_owner_silent_past_the_lease_is_taken_from_a_talking_one_never() -> None:
    owners = Owners(lease_s=10.0)
    rid: Any = "q1-lease"
    owners.touch("a", 0.0)
    owners.hold(rid, "a")
    owners.touch("a", 8.0)  # a keeps talking
    for asker in ("b", None):
        with pytest.raises(RolloutConflict) as refused:
            owners.check(rid, asker, 17.0)
        assert refused.value.code == "rollout_owned"
    owners.check(rid, "a", 17.0)
    owners.check(rid, "b", 18.5)  # a silent for 10.5 s: b takes it over
    assert (owners.of(rid), owners.takeovers) == ("b", 1)
    owners.check(rid + "-other", None, 0.0)  # an unowned rollout is anyone's


# ---- B5 ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_b5_a_restarted_gates_rollouts_are_gate_restarted_and_their_rows_orphaned(
    hosts: Hosts, sink: MemorySink
) -> None:
    async with _fleet(hosts) as fleet:
        for rid in ("b5-r0", "b5-r1"):  # r0 on gate-a, r1 on gate-b
            await fleet.open(rid)
        sim = simulate_rollout("b5-r0", seed=5, turns=2)
        await sink.put(sim.calls)  # what r0's captured calls left in the sink
        hosts.restart(URLS[0], Gate(GateConfig(require_open=True), sink=sink))

        closes = [RolloutClose(rollout_id=rid, reward=1.0) for rid in ("b5-r0", "b5-r1")]
        results = await fleet.close_many(closes, receipts="terminal")
        assert results[0].head_or_raise()[0] == 0  # the genesis head, not unknown_rollout
        assert results[0].receipt is not None
        assert results[0].receipt.failure_reason == "gate_restarted"
        assert results[1].receipt is not None
        assert results[1].receipt.failure_reason == "no_terminal"  # the other gate's: as ever
        (receipt,) = await fleet.fetch_receipts(["b5-r0"])
        assert receipt.failure_reason == "gate_restarted"
        assert fleet.lost() == {"b5-r0": "gate_restarted"}

        orphans = fleet.orphaned_keys(await sink.staged_keys())
        assert sorted(orphans) == sorted(sim.staged)
        await fleet.release_many(["b5-r0", "b5-r1"])

        with pytest.raises(ControlConflict) as refused:
            await fleet.open("b5-r0")  # its rows are still there: never a poisoned 200 later
        assert refused.value.code == "stale_rows"
        await sink.clear([StagingKey(k) for k in orphans])
        assert await fleet.open("b5-r0")  # cleared: the id starts cleanly
        await fleet.close("b5-r0")
        (receipt,) = await fleet.fetch_receipts(["b5-r0"])
        assert receipt.failure_reason == "no_terminal"


# ---- B6 ----------------------------------------------------------------------------------


def test_b6_a_second_gate_on_one_ledger_file_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokcap_vllm.server._serve import main

    path = tmp_path / "gate.ledger"
    first = Gate(GateConfig(ledger_path=str(path)))
    with pytest.raises(LedgerFileError) as refused:
        LedgerFile.open(path)
    assert refused.value.code == "ledger_file_locked"
    with pytest.raises(LedgerFileError):
        Gate(GateConfig(ledger_path=str(path)))
    argv = ["serve", "m", "--tokcap-sink", "memory", "--tokcap-ledger-path"]
    for given, code in ((path, "ledger_file_locked"), (tmp_path, "bad_ledger_path")):
        with pytest.raises(SystemExit) as exited:
            main([*argv, str(given)])
        assert exited.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.endswith(f"[{code}]"), line
    assert first.ledger_file is not None
    first.ledger_file.close()  # the first gate ends: the file is free
    LedgerFile.open(path)[0].close()


# ---- Q8, Q5 ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_q8_a_batch_close_body_over_the_bound_is_413() -> None:
    transport = httpx.ASGITransport(ControlPlane(Gate(), environ=ENV))
    body = {"rollouts": [{"rollout_id": f"q8-{i:07d}", "reward": 1.0} for i in range(40_000)]}
    raw = json.dumps(body).encode()
    assert len(raw) > 1_500_000
    async with httpx.AsyncClient(transport=transport, base_url="http://gate") as http:
        answer = await http.post(
            "/tokcap/v1/close", content=raw, headers={"authorization": f"Bearer {TOKEN}"}
        )
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "body_too_large"


def test_q5_a_messages_structured_outputs_extension_is_bounded() -> None:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    from tokcap_vllm.gate._messages import MAX_STRUCTURED_OUTPUTS_BYTES, messages_request

    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"json": schema},
    }
    with pytest.raises(TooLarge) as refused:
        anyio.run(messages_request, json.dumps(body).encode(), AnthropicServingMessages)
    assert refused.value.code == "structured_outputs_too_large"
    assert type(refused.value).status == 413
    body["structured_outputs"] = {"json": {"type": "object"}}
    assert len(json.dumps(body["structured_outputs"])) < MAX_STRUCTURED_OUTPUTS_BYTES
    assert anyio.run(messages_request, json.dumps(body).encode(), AnthropicServingMessages)
