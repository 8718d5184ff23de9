"""Containment (issue #14): a failure while committing one call poisons that rollout alone.

Against the session gate (real engine, real HTTP, real ledger file), while other rollouts
keep calling: a ledger-file write that fails, and a ledger that refuses a commit. The
victim's receipt is poisoned with the reason; every other rollout stages and verifies; the
gate keeps serving and staging; nothing reaches the task group `Gate.serve` runs.
"""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.vllm._helpers import CONTROL_TOKEN, client, control
from tokcap_core import Ledger, LedgerProtocolError
from tokcap_core.ledger import Staged
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"authorization": f"Bearer {CONTROL_TOKEN}"}


async def _turns(server: InProcessServer, rollout_id: str, turns: int) -> None:
    messages: list[Any] = [{"role": "user", "content": f"task {rollout_id}"}]
    async with client(server, rollout_id) as c:
        for turn in range(turns):
            r = await c.chat.completions.create(
                model=server.model, messages=messages, max_tokens=3, temperature=0.0
            )
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"more {turn}"},
            ]


async def _receipts(server: InProcessServer, rollout_ids: list[str]) -> dict[str, Any]:
    async with control(server) as cp:
        heads = {rid: await cp.close(rid, reward=1.0) for rid in rollout_ids}
        receipts = await cp.fetch_receipts(rollout_ids, expected_heads=heads)
    return {r.rollout_id: r for r in receipts}


def _staged(server: InProcessServer, rollout_id: str) -> int:
    return sum(isinstance(e.event, Staged) for e in server.gate.ledger(rollout_id).entries)


def _health(server: InProcessServer) -> dict[str, Any]:
    with httpx.Client(timeout=60) as http:
        answer = http.get(f"{server.base_url}/tokcap/v1/health", headers=AUTH)
    assert answer.status_code == 200
    body: dict[str, Any] = answer.json()
    return body


def _only_the_victim_failed(
    receipts: dict[str, Any], victim: str, reason: str, others: list[str]
) -> None:
    assert not receipts[victim].ok
    assert receipts[victim].failure_reason == reason
    for rid in others:
        assert receipts[rid].ok, receipts[rid]


def _a_new_rollout_is_captured(server: InProcessServer, rollout_id: str) -> None:
    anyio.run(_turns, server, rollout_id, 2)
    assert anyio.run(_receipts, server, [rollout_id])[rollout_id].ok


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """A real write failure: the kernel refuses to grow any regular file of this process past
    ``limit`` bytes (``EFBIG``; SIGXFSZ ignored so the write returns the error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_ledger_file_that_cannot_be_written_poisons_that_rollout_alone(
    server: InProcessServer,
) -> None:
    gate = server.gate
    assert gate.ledger_file is not None
    others = ["ct-file-a", "ct-file-b"]

    async def main() -> dict[str, Any]:
        async with anyio.create_task_group() as tg:
            for rid in others:
                tg.start_soon(_turns, server, rid, 1)
        await anyio.to_thread.run_sync(server.call, gate.drain)  # every commit is on file
        size = gate.ledger_file.path.stat().st_size  # type: ignore[union-attr]
        # the victim's first record gets 10 bytes onto the file, then the write fails: the
        # call is refused (issue #24: never served into a rollout its file cannot record)
        with _file_size_limit(size + 10), pytest.raises(openai.InternalServerError) as failed:
            await _turns(server, "ct-file-victim", 1)
        assert (failed.value.status_code, failed.value.code) == (503, "ledger_write_failed")
        async with anyio.create_task_group() as tg:  # everyone goes on
            for rid in others:
                tg.start_soon(_turns, server, rid, 2)
        with pytest.raises(openai.ConflictError) as refused:  # the victim's calls are refused
            await _turns(server, "ct-file-victim", 1)
        assert refused.value.code == "rollout_poisoned"
        return await _receipts(server, [*others, "ct-file-victim"])

    receipts = anyio.run(main)
    _only_the_victim_failed(receipts, "ct-file-victim", "ledger_write_failed:EFBIG", others)
    for rid in others:
        assert _staged(server, rid) == 3  # one conversation before the fault, one after
    assert _staged(server, "ct-file-victim") == 0  # refused at admission, later calls too
    assert gate.running
    assert _health(server)["status"] == "degraded"  # the victim is not fully on file
    assert gate.metrics()["tokcap/ledger_write_failures"] >= 1
    assert gate.metrics()["tokcap/requests_refused/rollout_poisoned"] >= 1
    with httpx.Client(timeout=60) as http:
        assert http.delete(
            f"{server.base_url}/tokcap/v1/rollouts/ct-file-victim", headers=AUTH
        ).is_success
    health = _health(server)
    assert (health["status"], health["serving"]) == ("ok", True)
    _a_new_rollout_is_captured(server, "ct-file-after")


class _RefusingLedger(Ledger):
    """Fault injection (a fault no client can cause any more: the gate refuses duplicate
    request ids before admission): this ledger refuses every ``Staged`` commit."""

    __slots__ = ()

    def append(self, event: Any) -> Any:
        if isinstance(event, Staged):
            raise LedgerProtocolError("injected_refusal", "this ledger refuses commits")
        return super().append(event)


def test_a_ledger_refusing_a_commit_poisons_that_rollout_alone(server: InProcessServer) -> None:
    gate = server.gate
    others = ["ct-ref-a", "ct-ref-b", "ct-ref-c"]

    async def swap() -> None:
        record = gate.book.join("ct-ref-victim")
        record.ledger = _RefusingLedger("ct-ref-victim")

    async def victim_turns() -> None:  # its first commit is refused, so its next call is
        with pytest.raises(openai.ConflictError) as refused:
            await _turns(server, "ct-ref-victim", 3)
        assert refused.value.code in ("rollout_poisoned", "parent_not_committed")

    async def main() -> dict[str, Any]:
        server.call(swap)
        async with anyio.create_task_group() as tg:
            for rid in others:
                tg.start_soon(_turns, server, rid, 3)
            tg.start_soon(victim_turns)
        return await _receipts(server, [*others, "ct-ref-victim"])

    before = gate.metrics().get("tokcap/contained_failures/injected_refusal", 0.0)
    receipts = anyio.run(main)
    _only_the_victim_failed(receipts, "ct-ref-victim", "ledger_refused:injected_refusal", others)
    for rid in others:
        assert len(receipts[rid].segments[0]) == 3
    assert gate.running
    assert gate.metrics()["tokcap/contained_failures/injected_refusal"] == before + 1
    _a_new_rollout_is_captured(server, "ct-ref-after")
