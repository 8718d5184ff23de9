"""Groups of synthetic rollouts for the pool tests, and sinks that misbehave on purpose.

The sinks subclass `ActorSink` and run inside a reassembler actor; they stall in
``publish`` so a test can kill the actor at a known point of a request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import anyio

from tokcap_core import (
    Ledger,
    ReassemblyRequest,
    StagedCall,
    TrainingRow,
    assemble_receipt,
    verify_manifest,
)
from tokcap_core.ledger import Closed, Failed, Witnesses, manifest_of
from tokcap_core.simulate import admit_call, simulate_rollout
from tokcap_ray import ActorSink

Kind = str  # "ok" | "forest" | "poisoned" | "tampered" | "missing"


def make_group(
    group_id: str, kinds: Sequence[Kind], *, seed: int = 0
) -> tuple[ReassemblyRequest, dict[str, StagedCall]]:
    """A request for one rollout per kind, and the staged calls a sink should hold.

    ``forest``: a rewritten history (two roots, two segments); ``poisoned``: a served
    engine failure; ``tampered``: a staged call whose digest is wrong; ``missing``:
    a staged call absent from the returned calls.
    """
    receipts, staged = [], {}
    rollout_ids = tuple(f"{group_id}-r{i}" for i in range(len(kinds)))
    for i, (rollout_id, kind) in enumerate(zip(rollout_ids, kinds, strict=True)):
        if kind == "poisoned":
            ledger = _poisoned_ledger(rollout_id)
            calls: dict[str, StagedCall] = {}
        else:
            sim = simulate_rollout(
                rollout_id,
                seed=seed * 1000 + i,
                turns=3,
                roots=2 if kind == "forest" else 1,
                routes=i % 2 == 0,
            )
            ledger, calls = sim.ledger, dict(sim.staged)
            first = next(iter(calls))
            if kind == "tampered":
                calls[first] = dataclasses.replace(calls[first], digest="00" * 32)
            elif kind == "missing":
                del calls[first]
        receipts.append(assemble_receipt(verify_manifest(manifest_of(ledger)), segments="all"))
        staged.update(calls)
    request = ReassemblyRequest(
        group_id=group_id,
        rollout_ids=rollout_ids,
        receipts=tuple(receipts),
        rewards=tuple(float(i % 3) for i in range(len(kinds))),
        max_seq_len=4096,
    )
    return request, staged


def _poisoned_ledger(rollout_id: str) -> Ledger:
    ledger = Ledger(rollout_id)
    call_id = admit_call(ledger, None, admitted_at=1, request_fingerprint="f")
    ledger.append(Failed(call_id=call_id, reason="engine_failed:oom", served=True))
    ledger.append(Closed(reward=0.0, witnesses=Witnesses()))
    return ledger


class ScriptedSink(ActorSink):
    """Misbehaves in ``publish`` for groups named after a script, so a test can kill the
    actor at a known point; every other group goes straight through.

    - ``stall-before-*``: sleeps `STALL_S` before writing (kill it there: nothing written);
    - ``stall-after-*``: writes every row, then sleeps (kill it there: all written);
    - ``half-*``: writes half the rows, sleeps, then the rest (a non-atomic store killed
      mid-write).
    """

    STALL_S = 2.0

    async def publish(self, rows: Mapping[str, TrainingRow]) -> None:
        first = next(iter(rows), "")
        if first.startswith("stall-before-"):
            await anyio.sleep(self.STALL_S)
        elif first.startswith("half-"):
            await super().publish(dict(list(rows.items())[: len(rows) // 2]))
            await anyio.sleep(self.STALL_S)
        await super().publish(rows)
        if first.startswith("stall-after-"):
            await anyio.sleep(self.STALL_S)
