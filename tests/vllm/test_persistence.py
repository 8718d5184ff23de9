"""The gate's ledger file: replay at start, torn tails, corruption, poisoning, compaction.

Unit tests run the real `Gate` and `LedgerFile` without an engine (ledgers fed with the
core's simulated rollouts). The restart test at the end kills a real ``tokcap-vllm
serve`` process with SIGKILL and starts it again on the same ledger file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tests.vllm._helpers import CONTROL_TOKEN, VLLM_ARGS
from tokcap.compose import ServedGate
from tokcap_core import assemble_receipt, verify_manifest
from tokcap_core.ledger import Closed, Poisoned, encode_manifest, manifest_of
from tokcap_core.simulate import simulate_rollout
from tokcap_vllm import (
    LEDGER_PATH_ENV,
    ControlPlaneClient,
    Gate,
    GateConfig,
    LedgerFileError,
)
from tokcap_vllm.persist import LedgerFile, read_ledger_records

_RUNNING: dict[Path, Gate] = {}


def _gate(path: Path, **config: object) -> Gate:
    """A gate on ``path``, started as a restarted process would: the previous gate on that
    file is gone first (its file closed, its lock let go)."""
    before = _RUNNING.pop(path, None)
    if before is not None and before.ledger_file is not None:
        before.ledger_file.close()
    gate = _RUNNING[path] = Gate(GateConfig(ledger_path=str(path), **config))  # type: ignore[arg-type]
    return gate


def _feed(gate: Gate, rollout_id: str, *, seed: int, close: bool) -> bytes | None:
    """Replay a simulated rollout's events into the gate (closing it through `Gate.close`)."""
    sim = simulate_rollout(rollout_id, seed=seed, turns=3)
    record = gate.book.join(rollout_id)
    *body, last = sim.ledger.entries
    for entry in body:
        gate._append(record, entry.event)  # what the capture path appends, without an engine
    if not close:
        return None
    assert isinstance(last.event, Closed)
    head = anyio.run(gate.close, rollout_id, last.event.reward, last.event.witnesses)
    assert head == sim.ledger.head
    return encode_manifest(manifest_of(gate.ledger(rollout_id)))


def test_closed_manifests_come_back_byte_identical_and_open_ones_poisoned(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    gate = _gate(path)
    before = {f"done-{i}": _feed(gate, f"done-{i}", seed=i, close=True) for i in range(3)}
    _feed(gate, "open-1", seed=7, close=False)
    assert gate.rollouts()["open-1"] == "open"

    restarted = _gate(path)
    assert {r: encode_manifest(manifest_of(restarted.ledger(r))) for r in before} == before
    assert restarted.rollouts()["open-1"] == "closed"
    state = verify_manifest(manifest_of(restarted.ledger("open-1")))
    assert state.poisoned == Poisoned(reason="gate_restarted")
    assert assemble_receipt(state).failure_reason == "gate_restarted"
    with pytest.raises(Exception, match="rollout_closed"):
        restarted.book.join("open-1")  # never silently resumed

    third = _gate(path)  # the poisoning was persisted: it is not applied twice
    assert encode_manifest(manifest_of(third.ledger("open-1"))) == encode_manifest(
        manifest_of(restarted.ledger("open-1"))
    )


def test_a_torn_last_record_is_ignored_and_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    gate = _gate(path)
    kept = _feed(gate, "kept", seed=1, close=True)
    _feed(gate, "torn", seed=2, close=False)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])  # the last record loses its tail
    records, torn = read_ledger_records(path.read_bytes())
    assert torn
    assert len(records["torn"]) == simulate_rollout("torn", seed=2, turns=3).ledger.head[0] - 2

    restarted = _gate(path)
    assert restarted.ledger_file is not None
    assert restarted.ledger_file.torn_tail_ignored
    assert encode_manifest(manifest_of(restarted.ledger("kept"))) == kept
    assert verify_manifest(manifest_of(restarted.ledger("torn"))).poisoned is not None
    assert path.read_bytes().endswith(b"\n")
    assert not read_ledger_records(path.read_bytes())[1]


def test_a_garbled_last_line_is_a_torn_write(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    _feed(_gate(path), "a", seed=1, close=True)
    with path.open("ab") as f:
        f.write(b'{"format":"tokcap/manifest/v1","rollout_id":"a","he\x00\x00\n')
    assert read_ledger_records(path.read_bytes())[1]
    assert _gate(path).rollouts() == {"a": "closed"}


def test_a_corrupt_record_before_the_tail_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    _feed(_gate(path), "a", seed=1, close=True)
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"seq":2', b'"seq":"2"')
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LedgerFileError) as info:
        _gate(path)
    assert info.value.code == "corrupt_record"


def test_a_missing_record_breaks_the_chain_and_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    _feed(_gate(path), "a", seed=1, close=True)
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:1] + lines[2:]))
    with pytest.raises(LedgerFileError) as info:
        _gate(path)
    assert info.value.code == "corrupt_ledger"


def test_released_rollouts_are_compacted_away(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    gate = _gate(path, compact_after_releases=2)
    for i in range(4):
        _feed(gate, f"r{i}", seed=i, close=True)
    gate.release("r0")
    gate.release("r1")
    size_before = path.stat().st_size
    file = gate.ledger_file
    assert file is not None
    assert file.should_compact

    async def compact_while_appending() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(file.compact, gate.held_ledgers)
            await anyio.sleep(0)  # the snapshot is taken; its rewrite runs in a thread
            assert file.compacting
            _feed_events(gate, "late", seed=9)  # appended meanwhile: must reach the new file

    anyio.run(compact_while_appending)
    assert path.stat().st_size < size_before
    records, torn = read_ledger_records(path.read_bytes())
    assert not torn
    assert set(records) == {"r2", "r3", "late"}
    assert len(records["late"]) == len(gate.ledger("late").entries)
    gate.release("r2")  # a release record after compaction still counts on restart
    assert set(_gate(path).rollouts()) == {"r3", "late"}


def _feed_events(gate: Gate, rollout_id: str, *, seed: int) -> None:
    record = gate.book.join(rollout_id)
    for entry in simulate_rollout(rollout_id, seed=seed, turns=2).ledger.entries[:-1]:
        gate._append(record, entry.event)  # what the capture path appends, without an engine


def test_a_released_id_used_again_starts_a_new_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    gate = _gate(path)
    _feed(gate, "again", seed=1, close=True)
    gate.release("again")
    second = _feed(gate, "again", seed=2, close=True)
    assert encode_manifest(manifest_of(_gate(path).ledger("again"))) == second


def test_the_start_rewrites_the_file_atomically(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    gate = _gate(path)
    _feed(gate, "a", seed=1, close=True)
    gate.release("a")
    _gate(path)
    assert path.read_bytes() == b""
    assert sorted(os.listdir(tmp_path)) == ["ledger.jsonl", "ledger.jsonl.lock"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_ledger_file_open_on_a_missing_file_creates_it(tmp_path: Path) -> None:
    file, ledgers = LedgerFile.open(tmp_path / "sub" / "ledger.jsonl")
    try:
        assert ledgers == []
        assert (tmp_path / "sub" / "ledger.jsonl").exists()
        assert "ledger.jsonl" in repr(file)
    finally:
        file.close()


# ---- a real gate process, killed and restarted on its ledger file ------------------------


def _served_gate(model: Path, ledger: Path, log: Path) -> ServedGate:
    """``tokcap-vllm serve`` on the ledger file, in its own process group, output to ``log``."""
    env = {
        LEDGER_PATH_ENV: str(ledger),
        "VLLM_LOGGING_LEVEL": "INFO",  # the most the server ever says, checked for the token
    }
    # a served gate names its sink; this test reads manifests only
    options = ["--tokcap-sink", "memory", *VLLM_ARGS]
    return ServedGate(model, options, token=CONTROL_TOKEN, log=log, env=env)


async def _converse(base_url: str, model: str, rollout_id: str, turns: int) -> Any:
    url = f"{base_url}/tokcap/rollouts/{rollout_id}/v1"
    messages: list[Any] = [{"role": "user", "content": f"hi {rollout_id}"}]
    response = None
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as c:
        for turn in range(turns):
            response = await c.chat.completions.create(
                model=model, messages=messages, max_tokens=4, temperature=0.0
            )
            messages += [
                {"role": "assistant", "content": response.choices[0].message.content or ""},
                {"role": "user", "content": f"turn {turn}"},
            ]
    return response


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_gate_restarts_on_its_ledger_file(tiny_model: Path, tmp_path: Path) -> None:
    """SIGKILL mid-run, restart: closed manifests byte-identical, open rollouts poisoned,
    a torn last record ignored, and the token in no line the server printed."""
    ledger, logs = tmp_path / "ledger.jsonl", [tmp_path / "first.log", tmp_path / "second.log"]
    model = str(tiny_model)

    first = _served_gate(tiny_model, ledger, logs[0])
    try:
        first.wait_healthy(CONTROL_TOKEN)

        async def before_crash() -> tuple[Any, ...]:
            await _converse(first.url, model, "kept", turns=2)
            await _converse(first.url, model, "in-flight", turns=1)
            async with ControlPlaneClient(first.url, CONTROL_TOKEN) as cp:
                head = await cp.close("kept", reward=1.0)
                kept = await cp.manifest_bytes("kept")
                with anyio.fail_after(60):  # the open rollout's call is committed (on file)
                    while "staged" not in (await cp.manifest_bytes("in-flight")).decode():
                        await anyio.sleep(0.1)
            return head, kept

        head, kept = anyio.run(before_crash)
    finally:
        first.kill()
    with ledger.open("ab") as f:  # the crash also cut a record short
        f.write(b'{"format":"tokcap/manifest/v1","rollout_id":"in-fl')

    second = _served_gate(tiny_model, ledger, logs[1])
    try:
        second.wait_healthy(CONTROL_TOKEN)

        async def after_restart() -> tuple[Any, ...]:
            async with ControlPlaneClient(second.url, CONTROL_TOKEN) as cp:
                served = await cp.manifest_bytes("kept")
                receipts = await cp.fetch_receipts(
                    ["kept", "in-flight"], expected_heads={"kept": head}
                )
                listed = {r.rollout_id: r.state for r in await cp.rollouts()}
            with pytest.raises(openai.ConflictError, match="rollout_closed"):
                await _converse(second.url, model, "in-flight", turns=1)
            return served, receipts, listed

        served, (kept_receipt, open_receipt), listed = anyio.run(after_restart)
    finally:
        second.stop()

    assert served == kept
    assert (kept_receipt.status, kept_receipt.ledger_head) == ("verified", head)
    assert (open_receipt.status, open_receipt.failure_reason) == ("poisoned", "gate_restarted")
    assert listed == {"kept": "closed", "in-flight": "closed"}
    for log in logs:
        assert CONTROL_TOKEN.encode() not in log.read_bytes()
        assert log.read_bytes()  # the server did print: the check above looked at real output
