"""Batch closes on the real gate: one durable write for a step's rollouts, one typed answer
per rollout, the ledgers' hash chains exactly as single closes leave them."""

from __future__ import annotations

import errno
import json
import os
import types
from typing import Any

import anyio
import httpx
import pytest

import tokcap_vllm.persist._ledger_file as persist
from tests.vllm._helpers import client, control
from tokcap_core import Receipt
from tokcap_core.ledger import CLOSED, Closed, manifest_of
from tokcap_vllm import (
    CloseResult,
    ControlConflict,
    ControlNotFound,
    ControlUnreachable,
    InProcessServer,
    RolloutClose,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def _play(server: InProcessServer, rollout_ids: list[str]) -> dict[str, str]:
    """One short chat per rollout, concurrently; the response id of each."""
    ids: dict[str, str] = {}

    async def one(rid: str) -> None:
        async with client(server, rid) as c:
            answer = await c.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": f"hello {rid}"}],
                max_tokens=3,
                temperature=0.0,
            )
            ids[rid] = answer.id

    async with anyio.create_task_group() as tg:
        for rid in rollout_ids:
            tg.start_soon(one, rid)
    return ids


def test_a_batch_close_is_one_fsync_with_a_typed_answer_per_rollout(
    server: InProcessServer,
) -> None:
    rids = [f"cm-ok-{i}" for i in range(4)]
    ledger_file = server.gate.ledger_file
    assert ledger_file is not None

    async def main() -> tuple[Any, ...]:
        answered = await _play(server, [*rids, "cm-twice"])
        async with control(server) as cp:
            await cp.close("cm-twice", reward=0.0)
            before = ledger_file.syncs
            results = await cp.close_many(
                [
                    RolloutClose(rollout_id=rids[0], reward=1.0, response_id=answered[rids[0]]),
                    RolloutClose(rollout_id="cm-never-seen", reward=1.0),
                    *(RolloutClose(rollout_id=r, reward=0.5) for r in rids[1:]),
                    RolloutClose(rollout_id="cm-twice", reward=1.0),
                ]
            )
            syncs = ledger_file.syncs - before
            heads = {r.rollout_id: r.head for r in results if r.ok}
            receipts = await cp.fetch_receipts(rids, expected_heads=heads)  # type: ignore[arg-type]
            await cp.release_many(rids)
            listed = {item.rollout_id for item in await cp.rollouts()}
        return results, syncs, receipts, listed

    results, syncs, receipts, listed = anyio.run(main)
    assert syncs == 1  # four heads made durable by one fsync
    assert [r.rollout_id for r in results] == [
        rids[0],
        "cm-never-seen",
        *rids[1:],
        "cm-twice",
    ]
    missing, twice = results[1], results[-1]
    assert isinstance(missing.error, ControlNotFound)
    assert (missing.error.status, missing.error.code) == (404, "unknown_rollout")
    assert isinstance(twice.error, ControlConflict)
    assert twice.error.code == "rollout_closed"
    with pytest.raises(ControlConflict):
        twice.head_or_raise()
    assert [r.status for r in receipts] == ["verified"] * 4
    assert receipts[0].terminal_selection == "response_id"
    assert [r.reward for r in receipts] == [1.0, 0.5, 0.5, 0.5]
    assert not listed & set(rids)  # released, concurrently


def test_the_batch_leaves_each_ledger_as_a_single_close_would(server: InProcessServer) -> None:
    """Same events, same digests: a batch-closed ledger replays, and its last entry is the
    plain `Closed` event a single close appends."""

    async def main() -> list[CloseResult]:
        await _play(server, ["cm-chain"])
        async with control(server) as cp:
            return await cp.close_many([RolloutClose(rollout_id="cm-chain", reward=0.25)])

    (result,) = anyio.run(main)
    manifest = manifest_of(server.gate.ledger("cm-chain"))
    assert result.head_or_raise() == manifest.head
    last = manifest.entries[-1].event
    assert isinstance(last, Closed)
    assert last.reward == 0.25
    assert [type(e.event).__name__ for e in manifest.entries] == ["Admitted", "Staged", "Closed"]


def test_a_batch_close_declares_a_harness_terminal_without_a_request_of_its_own(
    server: InProcessServer,
) -> None:
    """An item's ``terminal_response_id`` is declared just before its close, in the same
    request: the ledger holds what ``declare_terminal`` then ``close`` leave, the receipt's
    terminal is the declared call. A declaration the gate refuses is that rollout's typed
    answer alone; the rollout stays open, and closes later."""
    rids = ["cm-declared-a", "cm-declared-b", "cm-declared-bad"]

    async def main() -> tuple[list[CloseResult], list[CloseResult], list[Receipt], list[str]]:
        async with client(server, rids[0]) as c:  # two calls: the first is the declared one
            first = await c.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "one"}], max_tokens=3
            )
            await c.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "two"}], max_tokens=3
            )
        answered = await _play(server, rids[1:])
        async with control(server) as cp:
            results = await cp.close_many(
                [
                    RolloutClose(rollout_id=rids[0], reward=1.0, terminal_response_id=first.id),
                    RolloutClose(
                        rollout_id=rids[1], reward=0.5, terminal_response_id=answered[rids[1]]
                    ),
                    RolloutClose(rollout_id=rids[2], reward=0.5, terminal_response_id="nope"),
                ]
            )
            later = await cp.close_many([RolloutClose(rollout_id=rids[2], reward=0.0)])
            heads = {r.rollout_id: r.head for r in [*results[:2], *later]}
            receipts = await cp.fetch_receipts(rids, expected_heads=heads)  # type: ignore[arg-type]
            ledger = manifest_of(server.gate.ledger(rids[0]))
            await cp.release_many(rids)
        return results, later, receipts, [type(e.event).__name__ for e in ledger.entries]

    results, later, receipts, events = anyio.run(main)
    assert [r.ok for r in results] == [True, True, False]
    refused = results[2].error
    assert refused is not None
    assert (refused.status, refused.code) == (422, "unknown_terminal")
    assert later[0].ok  # left open by the refusal, closed by the next batch
    assert [(r.terminal_call_id, r.terminal_selection) for r in receipts[:2]] == [
        ("c000001", "declared"),
        ("c000001", "declared"),
    ]
    assert receipts[2].terminal_selection != "declared"
    assert [r.status for r in receipts] == ["verified"] * 3
    assert events[-2:] == ["TerminalDeclared", "Closed"]
    with pytest.raises(ValueError, match="not both"):
        RolloutClose(rollout_id=rids[0], terminal_call_id="c000001", terminal_response_id="x")


def test_a_failed_fsync_is_reported_for_every_rollout_of_the_batch(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault is injected (a disk cannot be made to fail fsync here): the ledger file's
    fsync raises EIO; every rollout the batch closed gets ``ledger_sync_failed``, the
    unknown one its own 404, and a later batch is durable again."""
    rids = ["cm-sync-a", "cm-sync-b"]

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "injected fsync failure")

    async def main() -> tuple[list[CloseResult], list[CloseResult]]:
        await _play(server, [*rids, "cm-sync-after"])
        fake_os = types.SimpleNamespace(**{**vars(os), "fsync": failing_fsync})
        async with control(server) as cp:
            with monkeypatch.context() as patch:
                patch.setattr(persist, "os", fake_os)
                failed = await cp.close_many(
                    [
                        RolloutClose(rollout_id=rids[0], reward=1.0),
                        RolloutClose(rollout_id="cm-sync-unknown", reward=1.0),
                        RolloutClose(rollout_id=rids[1], reward=1.0),
                    ]
                )
            after = await cp.close_many([RolloutClose(rollout_id="cm-sync-after", reward=1.0)])
        return failed, after

    failed, after = anyio.run(main)
    a, unknown, b = failed
    for result in (a, b):
        assert isinstance(result.error, ControlUnreachable)
        assert (result.error.status, result.error.code) == (503, "ledger_sync_failed")
    assert isinstance(unknown.error, ControlNotFound)
    assert after[0].ok
    assert server.gate.ledger(rids[0]).status is CLOSED  # closed all the same, as `close`


def test_a_batch_body_is_checked_whole_and_each_rollout_on_its_own() -> None:
    """No engine: a real gate's control plane over ASGI. Repeated ids refuse the batch
    (422); a bad witness or id fails its own rollout only, with the single close's code."""
    from tokcap_vllm import Gate
    from tokcap_vllm.extend import ControlPlane

    gate = Gate()
    gate.open("cm-unit-a")
    plane = ControlPlane(gate, environ={"TOKCAP_CONTROL_TOKEN": "unit-token"})

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(plane),
            base_url="http://gate",
            headers={"authorization": "Bearer unit-token"},
        ) as http:
            twice = await http.post(
                "/tokcap/v1/close",
                json={"rollouts": [{"rollout_id": "cm-unit-a"}, {"rollout_id": "cm-unit-a"}]},
            )
            mixed = await http.post(
                "/tokcap/v1/close",
                json={
                    "rollouts": [
                        {"rollout_id": "cm-unit-a", "reward": 1.0},
                        {"rollout_id": "bad id!"},
                        {
                            "rollout_id": "cm-unit-b",
                            "witnesses": {"content_fingerprint": "not-hex"},
                        },
                    ]
                },
            )
        return twice, mixed

    twice, mixed = anyio.run(main)
    assert twice.status_code == 422
    assert twice.json()["error"]["code"] == "bad_body"
    assert mixed.status_code == 200
    ok, bad_id, bad_witness = mixed.json()["results"]
    assert ok["head"]["seq"] >= 1
    assert (bad_id["error"]["status"], bad_id["error"]["code"]) == (400, "bad_rollout_id")
    assert bad_witness["error"]["code"] == "bad_content_fingerprint"


class _Wire(httpx.AsyncBaseTransport):
    """Counts the requests sent; with ``rewrite_heads``, a stand-in for a gate whose batch
    close answers heads its manifests do not end at (a fault a real gate cannot be made to
    show): every head hash in the answer is replaced."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, rewrite_heads: bool) -> None:
        self.inner = inner
        self.rewrite_heads = rewrite_heads
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        if self.rewrite_heads and request.url.path.endswith("/close"):
            answer = json.loads(body)
            for outcome in answer["results"]:
                outcome["head"]["hash"] = "0" * 64
            body = json.dumps(answer).encode()
        return httpx.Response(response.status_code, content=body)


@pytest.mark.parametrize("fault", ["none", "over_bound", "wrong_head"])
def test_a_batch_close_verifies_the_receipts_it_answers(fault: str) -> None:
    """No engine: a real gate's control plane over ASGI. ``close_many(receipts=...)`` gives
    each closed rollout the receipt `fetch_receipts` verifies; a manifest over the gate's
    bound is left out of the answer and fetched (poisoned ``manifest_too_large``, as a
    fetch is), and a manifest that does not end at the answered head is poisoned
    ``unexpected_head``."""
    from tokcap_vllm import ControlPlaneClient, Gate, GateConfig
    from tokcap_vllm.extend import ControlPlane

    bound = 64 if fault == "over_bound" else GateConfig().max_manifest_bytes
    gate = Gate(GateConfig(max_manifest_bytes=bound))
    rids = ["cm-r-a", "cm-r-b"]
    for rid in rids:
        gate.open(rid)
    plane = ControlPlane(gate, environ={"TOKCAP_CONTROL_TOKEN": "unit-token"})
    wire = _Wire(httpx.ASGITransport(plane), rewrite_heads=fault == "wrong_head")

    async def main() -> tuple[list[CloseResult], int, list[Receipt]]:
        async with ControlPlaneClient("http://gate", "unit-token", transport=wire) as cp:
            closes = [RolloutClose(rollout_id=rid, reward=1.0) for rid in rids]
            results = await cp.close_many(closes, receipts="terminal")
            sent = wire.requests
            heads = {r.rollout_id: r.head_or_raise() for r in results}
            return results, sent, await cp.fetch_receipts(rids, expected_heads=heads)

    results, sent, fetched = anyio.run(main)
    assert sent == (1 + len(rids) if fault == "over_bound" else 1)  # left-out ones fetched
    assert [r.receipt for r in results] == fetched
    reasons = {
        "none": "no_terminal",  # opened, no calls
        "over_bound": "manifest_invalid:manifest_too_large",
        "wrong_head": "manifest_invalid:unexpected_head",
    }
    assert [r.failure_reason for r in fetched] == [reasons[fault]] * 2


def test_a_rollout_released_while_its_batch_close_is_made_durable_fails_alone() -> None:
    """No engine: a real gate's control plane over ASGI. Its owner releases a rollout while
    the batch close that closed it waits for the observers to make it durable (an observer
    attached with `Gate.attach` sends the release then). The batch still answers every
    rollout: the released one closed, its manifest gone (its receipt is poisoned when
    fetched), the other's receipt as ever."""
    from tokcap_vllm import ControlPlaneClient, Gate, GateConfig
    from tokcap_vllm.extend import ControlPlane
    from tokcap_vllm.persist import GateHooks

    gate = Gate(GateConfig())
    rids = ["cm-rel-a", "cm-rel-b"]
    for rid in rids:
        gate.open(rid)
    plane = ControlPlane(gate, environ={"TOKCAP_CONTROL_TOKEN": "unit-token"})
    transport = httpx.ASGITransport(plane)
    released: list[str] = []

    class ReleaseOnClose(GateHooks):
        async def on_close(self, rollout_id: str) -> None:
            if rollout_id == rids[0]:
                async with ControlPlaneClient(
                    "http://gate", "unit-token", transport=transport
                ) as cp:
                    await cp.release(rollout_id)
                released.append(rollout_id)

    gate.attach(ReleaseOnClose())

    async def main() -> list[CloseResult]:
        async with ControlPlaneClient("http://gate", "unit-token", transport=transport) as cp:
            closes = [RolloutClose(rollout_id=rid, reward=1.0) for rid in rids]
            return await cp.close_many(closes, receipts="terminal")

    results = anyio.run(main)
    assert released == [rids[0]]
    assert [r.rollout_id for r in results] == rids
    assert all(r.error is None and r.head is not None for r in results), results
    gone, kept = (r.receipt for r in results)
    assert gone is not None
    assert kept is not None
    assert gone.status == "poisoned"
    assert gone.failure_reason == "manifest_invalid:unknown_rollout"  # its fetch: 404
    assert kept.failure_reason == "no_terminal"  # opened, no calls: as any batch close
    assert rids[0] not in gate.rollouts()
    assert rids[1] in gate.rollouts()
