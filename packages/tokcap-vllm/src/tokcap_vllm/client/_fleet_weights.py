"""`FleetWeightSync`: one weight version for a fleet of gates.

A fleet version is current only when every gate reports it (`current_version`). A push
(`push`) checks and stages on every gate concurrently and swaps each one; the rule:

- As soon as the push fails on any gate, every gate is held (``POST
  /tokcap/v1/weights/hold``: captured calls answer 503 ``weights_unavailable``), the gates
  whose own push succeeded included, and those still pushing once they finish: no gate
  admits captured calls at a version the rest of the fleet may not have.
- Only a push that succeeded on every gate releases them all. Until then they stay held,
  whatever a single gate's later push does (a gate's successful push does not lift the
  fleet's hold).
- Calls served before the hold stay valid: each records the version(s) it was sampled with.

With ``transport="shm"`` (gates on the trainer's host) the push file is written once and
read by every gate's engine (the fleet's `tokcap_vllm.transfer._shm.PushFile`, rewritten in place
push after push, removed by `aclose`); with ``"http"`` each gate gets its own upload.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from tokcap_core import TokcapError

from ..api import WeightInfo
from ..errors import WeightPushError, WeightSyncError
from ..transfer import SHM_DIR, PushFile, PushMode, check_push
from ._http import AsyncClosing, each_concurrently
from ._weight_client import GateWeightClient, PushTransport, StagedPush, check_while_staging

if TYPE_CHECKING:
    import torch

__all__ = ["FleetPushError", "FleetWeightSync", "GateOutcome"]


@dataclass(frozen=True, slots=True)
class GateOutcome:
    """What one gate's part of a fleet push did: ``error`` is the code (None: it loaded)."""

    url: str
    error: str | None
    message: str = ""


class FleetPushError(WeightSyncError):
    """A fleet push failed on at least one gate; every gate is held. ``outcomes``: per gate."""

    outcomes: tuple[GateOutcome, ...] = ()


class FleetWeightSync(AsyncClosing):
    """Pushes to N gates as one; build from ``[(url, token), ...]`` or from clients."""

    def __init__(
        self,
        gates: Iterable[tuple[str, str] | GateWeightClient],
        *,
        transport: PushTransport = "shm",
        mode: PushMode = "wait",
        shm_dir: str = SHM_DIR,
    ) -> None:
        self.clients: list[GateWeightClient] = [
            g
            if isinstance(g, GateWeightClient)
            else GateWeightClient(g[0], g[1], transport=transport, mode=mode, shm_dir=shm_dir)
            for g in gates
        ]
        if not self.clients:
            raise WeightPushError("no_gates", "a fleet has at least one gate")
        self.shm_dir = shm_dir
        self._file = PushFile(shm_dir)

    def __repr__(self) -> str:
        return f"FleetWeightSync({[c.base_url for c in self.clients]!r})"

    async def aclose(self) -> None:
        """Close every gate's connections; remove the push file."""
        self._file.remove()
        for client in self.clients:
            await client.aclose()

    async def drop(self, url: str) -> None:
        """Stop pushing to the gate at ``url`` (one the trainer lost; its connections are
        closed): the fleet's version is then the remaining gates'. `WeightPushError`
        ``no_gates`` if it is the last one, ``unknown_gate`` if it is not in the fleet."""
        kept = [c for c in self.clients if c.base_url != url.rstrip("/")]
        if len(kept) == len(self.clients):
            raise WeightPushError("unknown_gate", f"{url} is not a gate of this fleet")
        if not kept:
            raise WeightPushError("no_gates", f"{url} was the fleet's last gate")
        dropped = [c for c in self.clients if c not in kept]
        self.clients = kept
        for client in dropped:
            await client.aclose()

    async def infos(self) -> list[WeightInfo]:
        """Every gate's `WeightInfo`, in order (concurrently)."""
        return await each_concurrently(self.clients, GateWeightClient.info)

    async def current_version(self) -> int | None:
        """The fleet's version: the one every gate serves READY and unheld, else None."""
        infos = await self.infos()
        versions = {i.version for i in infos if i.phase == "READY"}
        return versions.pop() if len(versions) == 1 and len(infos) == len(self.clients) else None

    async def hold(self, reason: str) -> list[GateOutcome]:
        """Hold every gate (concurrently, best effort: an unreachable gate is reported)."""
        outcomes: list[GateOutcome | None] = [None] * len(self.clients)

        async def one(i: int) -> None:
            client = self.clients[i]
            try:
                await client.hold(reason)
                outcomes[i] = GateOutcome(client.base_url, None)
            except TokcapError as e:
                outcomes[i] = GateOutcome(client.base_url, e.code, str(e))

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for i in range(len(self.clients)):
                    tg.start_soon(one, i)
        return [o for o in outcomes if o is not None]

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> list[WeightInfo]:
        """Load ``weights`` as ``version`` on every gate; see the module for the rule.

        Returns every gate's `WeightInfo` (all READY at ``version``, released). Raises
        `FleetPushError` (every gate held, ``outcomes`` per gate).
        """
        outcomes: list[GateOutcome | None] = [None] * len(self.clients)
        shared: list[StagedPush] = []
        checked: list[tuple[object, list[tuple[str, torch.Tensor]]]] = []
        lock = anyio.Lock()
        held = False

        async def hold_all(reason: str) -> None:
            nonlocal held
            if not held:
                held = True
                await self.hold(reason)

        async def one(i: int) -> None:
            client = self.clients[i]
            try:
                await client.check_version(version)
                async with lock:  # one check and one file for gates that agree on the spec
                    staged = await self._check_and_stage(client, weights, checked, shared)
                await client.swap(staged, version)
                outcomes[i] = GateOutcome(client.base_url, None)
            except TokcapError as e:
                outcomes[i] = GateOutcome(client.base_url, e.code, str(e))
                await hold_all(f"fleet push of version {version} failed on {client.base_url}")

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(self.clients)):
                    tg.start_soon(one, i)
        except BaseException:
            await hold_all(f"fleet push of version {version} was interrupted")
            raise
        done = [o for o in outcomes if o is not None]
        failed = [o for o in done if o.error is not None]
        if failed or held:
            await hold_all(f"fleet push of version {version} failed")
            error = FleetPushError(
                "fleet_push_failed",
                "; ".join(f"{o.url}: {o.error} {o.message}" for o in failed)
                + " — every gate is held until a push succeeds on all",
            )
            error.outcomes = tuple(done)
            raise error
        return await self._release_all()

    async def _check_and_stage(
        self,
        client: GateWeightClient,
        weights: Mapping[str, torch.Tensor],
        checked: list[tuple[object, list[tuple[str, torch.Tensor]]]],
        shared: list[StagedPush],
    ) -> StagedPush:
        """Shared memory: one file for the fleet, written by the first gate to get here while
        its finite-values check runs (`check_while_staging`); the file is the fleet's, so a
        push refused there reached no gate."""
        if client.transport != "shm" or client.shm_dir != self.shm_dir:
            return await client.stage(await _checked(client, weights, checked))
        if shared:
            await _checked(client, weights, checked)
            return shared[0]
        spec = await client.spec()
        tensors = await anyio.to_thread.run_sync(
            functools.partial(check_push, weights, spec[0], tied=spec[1], check_finite=False)
        )
        if client.check_finite:
            staged = await check_while_staging(tensors, self._write)
        else:
            staged = await self._write(tensors)
        checked.append((spec, tensors))
        shared.append(staged)
        return staged

    async def _write(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> StagedPush:
        try:
            path, entries = await anyio.to_thread.run_sync(self._file.write, tensors)
        except OSError as e:
            raise WeightSyncError("stage_failed", str(e)) from e
        return StagedPush(path, entries, owned_here=True)

    async def _release_all(self) -> list[WeightInfo]:
        return await each_concurrently(self.clients, GateWeightClient.release)


async def _checked(
    client: GateWeightClient,
    weights: Mapping[str, torch.Tensor],
    checked: list[tuple[object, list[tuple[str, torch.Tensor]]]],
) -> list[tuple[str, torch.Tensor]]:
    spec = await client.spec()
    for known, tensors in checked:
        if known == spec:
            return tensors
    tensors = await client.check(weights)
    checked.append((spec, tensors))
    return tensors
