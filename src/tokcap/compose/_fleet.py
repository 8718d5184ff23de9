"""A run's fleet of served gates: start them or take them, push to the live ones, report.

`fleet_gates` starts N ``tokcap-vllm serve`` gates on the run's Ray (`served_gates` with
`served_gate_options`) or takes the URLs of gates someone else started; `tokcap train` and
`tokcap demo` both run through it. `push_to_live_gates` is the fleet's weight push when
gates may die: a gate the `tokcap_vllm.GateFleet` lost (it stopped answering) is dropped
from the `tokcap_vllm.weights.FleetWeightSync` before the push, and a push that failed on
a gate that no longer answers is pushed again without it. Decision: a run goes on with
the gates that answer (their rollouts train; the lost gate's are poisoned
``gate_unreachable`` and counted per gate), because a fleet exists to outlive one replica;
it stops with a typed error only when no gate answers, or when a push fails on a gate
that still answers (a real push failure: every gate stays held, `FleetPushError`).
`gate_entries` is ``summary.json``'s ``gates``; `lost_receipts` counts, per gate, the
receipts a lost gate's rollouts got (lost with their gate, not failed verifications).
`tokcap.compose.place` wires them into a run (``tokcap demo --gates``, ``tokcap train
--gates``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from tokcap_core import CaptureConfig, ConfigError, Receipt
from tokcap_core.reasons import GATE_UNREACHABLE, reason_bucket
from tokcap_tq import TQSinkConfig
from tokcap_vllm import GateFleet
from tokcap_vllm.weights import FleetPushError, FleetWeightSync, WeightInfo

from ._served import served_gate_options, served_gates
from ._stack import StageHook

if TYPE_CHECKING:
    import torch

__all__ = [
    "TOKEN_ENV",
    "FleetGate",
    "drop_dead_gates",
    "fleet_gates",
    "fleet_token",
    "gate_entries",
    "gate_versions",
    "lost_receipts",
    "push_to_live_gates",
    "served_model",
]

TOKEN_ENV = "TOKCAP_CONTROL_TOKEN"
"""Where a run finds the control token of gates someone else started."""


@dataclass(frozen=True, slots=True)
class FleetGate:
    """One gate of a run's fleet: its URL and, when this run started it, its process id."""

    url: str
    pid: int | None = None


@contextlib.contextmanager
def fleet_gates(
    model: str | Path,
    *,
    count: int,
    urls: Sequence[str],
    sink: TQSinkConfig,
    token: str,
    vllm_args: Sequence[str],
    log_dir: Path,
    gate_options: Sequence[str] = (),
    stage: StageHook | None = None,
) -> Iterator[list[FleetGate]]:
    """``count`` gates started here on the Ray cluster this process is connected to (their
    logs under ``log_dir``; ``gate_options`` added to `served_gate_options`), or, with
    ``count == 0``, the gates at ``urls``. Started gates are stopped on exit."""
    if not count:
        yield [FleetGate(url.rstrip("/")) for url in urls]
        return
    import ray

    address = ray.get_runtime_context().gcs_address
    options = [*served_gate_options(sink, address), *gate_options, *vllm_args]
    with contextlib.ExitStack() as running:
        label = f"start {count} tokcap-vllm serve gates"
        with stage(label) if stage is not None else contextlib.nullcontext():
            started = running.enter_context(
                served_gates(model, count, options, token=token, log_dir=log_dir)
            )
        yield [FleetGate(g.url, g.pid) for g in started]


async def served_model(url: str) -> str:
    """The model id the gate at ``url`` serves (vLLM's ``GET /v1/models``): what a harness
    names in its requests to gates someone else started."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        answer = await client.get("/v1/models")
        answer.raise_for_status()
        model: str = answer.json()["data"][0]["id"]
        return model


def fleet_token(urls: Sequence[str], capture: CaptureConfig) -> str:
    """The fleet's control token: ``TOKCAP_CONTROL_TOKEN`` (required with gates someone
    else started at ``urls``: `ConfigError` ``token_env_missing``), else the run's own."""
    if urls and not os.environ.get(TOKEN_ENV):
        raise ConfigError("token_env_missing", f"--gate URL needs the gates' token in {TOKEN_ENV}")
    token = os.environ.get(TOKEN_ENV) or capture.control_token
    assert token is not None
    return token


async def push_to_live_gates(
    fleet: GateFleet,
    weights: FleetWeightSync,
    state: Mapping[str, torch.Tensor],
    version: int,
) -> list[WeightInfo]:
    """``weights.push(state, version)`` to the gates that still answer (see the module).

    Raises `FleetPushError` when the push fails on a gate that answers, and
    `tokcap_vllm.weights.WeightPushError` ``no_gates`` when none is left.
    """
    await _drop_lost(fleet, weights)
    try:
        return await weights.push(state, version)
    except FleetPushError as e:
        failed = [o.url for o in e.outcomes if o.error is not None]
        if not failed or any([await fleet.probe(url) for url in failed]):
            raise
        await _drop_lost(fleet, weights)
        return await weights.push(state, version)


async def drop_dead_gates(fleet: GateFleet, weights: FleetWeightSync) -> list[str]:
    """Probe every gate ``weights`` pushes to (`GateFleet.probe`: one that does not answer
    is marked lost, its open rollouts poisoned ``gate_unreachable``), stop pushing to the
    lost ones, and return their URLs. What a trainer runs before a push while the gates
    serve (``--async``): a push that fails on a gate nobody knew was dead holds every gate
    (captured calls answer 503) until it is pushed again without it. `WeightPushError`
    ``no_gates`` when none answers."""
    async with anyio.create_task_group() as tg:
        for client in weights.clients:
            tg.start_soon(fleet.probe, client.base_url)
    before = [c.base_url for c in weights.clients]
    await _drop_lost(fleet, weights)
    kept = {c.base_url for c in weights.clients}
    return [url for url in before if url not in kept]


async def _drop_lost(fleet: GateFleet, weights: FleetWeightSync) -> None:
    pushing = {c.base_url for c in weights.clients}
    for report in fleet.report():
        if not report.alive and report.url in pushing:
            await weights.drop(report.url)


async def gate_versions(fleet: GateFleet, weights: FleetWeightSync) -> dict[str, int]:
    """``{url: version}`` of every gate that still answers (the lost ones dropped first)."""
    await _drop_lost(fleet, weights)
    infos = await weights.infos()
    return {c.base_url: i.version for c, i in zip(weights.clients, infos, strict=True)}


def lost_receipts(fleet: GateFleet, receipts: Iterable[Receipt]) -> dict[str, int]:
    """``{gate url: n}``: of ``receipts``, those poisoned ``gate_unreachable`` (their gate
    stopped answering while the rollout was open), by the gate that owned the rollout."""
    lost: dict[str, int] = {}
    for receipt in receipts:
        if receipt.ok or reason_bucket(receipt.failure_reason or "") != GATE_UNREACHABLE:
            continue
        url = fleet.gate_url(receipt.rollout_id)
        lost[url] = lost.get(url, 0) + 1
    return lost


def gate_entries(
    fleet: GateFleet,
    gates: Sequence[FleetGate],
    calls: Mapping[str, int],
    versions: Mapping[str, int],
) -> list[dict[str, Any]]:
    """``summary.json``'s ``gates``: per gate ``url``, ``pid`` (None: started elsewhere),
    ``rollouts`` opened there, captured ``calls``, ``weight_version`` (None: lost), and
    ``alive`` / ``unreachable`` (rollouts poisoned because it stopped answering)."""
    pids = {g.url: g.pid for g in gates}
    return [
        {
            "url": report.url,
            "pid": pids.get(report.url),
            "rollouts": report.opened,
            "calls": calls.get(report.url, 0),
            "weight_version": versions.get(report.url),
            "alive": report.alive,
            "unreachable": report.unreachable,
        }
        for report in fleet.report()
    ]
