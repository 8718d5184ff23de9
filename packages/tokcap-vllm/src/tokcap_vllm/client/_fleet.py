"""`GateFleet`: the trainer's client over N gates (each its own ``tokcap-vllm serve``).

Each rollout belongs to one gate for its whole life: `GateFleet.open` picks the live gate
with the fewest open rollouts (ties: the first given), opens the rollout there (``POST
/tokcap/v1/rollouts/{id}/open``) and returns that rollout's OpenAI base URL for the
harness; close, terminal, receipts and release go to the owning gate. Run the gates with
``--tokcap-require-open`` and a call sent to the wrong gate is refused (404
``unknown_rollout``) instead of splitting a rollout's custody over two gates.

A gate that stops answering (a transport failure, after the client's retries) is marked
lost: each rollout open on it (or closed there, receipt not yet fetched) is poisoned
(``gate_unreachable``), its close returns the rollout's genesis head and its receipt is
poisoned without asking the gate. Every other gate's rollouts go on as before.
`GateFleet.report` counts both per gate; `GateFleet.orphaned_keys` names the staged rows
the lost rollouts left in the sink.

A gate restarted on its port (a new process: a new instance id, `Health.instance`) has
lost the rollouts opened on its earlier instance: before a batch close or a receipt fetch
the fleet compares each gate's instance with the one each rollout was opened under, and
those rollouts are lost ``gate_restarted`` (genesis head, poisoned receipt, their rows in
`orphaned_keys`), never ``unknown_rollout`` or a failed manifest. Opening such an id again
is refused by the gate (``stale_rows``) until its rows are cleared.

The fleet is one owner (``owner``, a random token unless given; see
`tokcap_vllm.gate._rollouts.Owners`):
every request carries it, so another trainer on the same gates can neither close, release
nor reclaim this fleet's rollouts while it is active, nor open one of its ids. Opens of one
id that race share the first one's placement.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import anyio
import attrs

from tokcap_core import Manifest, Receipt
from tokcap_core.ids import StagingKey, validate_rollout_id
from tokcap_core.ledger import genesis_hash
from tokcap_core.reasons import GATE_RESTARTED, GATE_UNREACHABLE, make_reason

from ..errors import ControlConflict, ControlNotFound, ControlPlaneError, ControlUnreachable
from ._client import ControlPlaneClient
from ._closes import CloseResult, RolloutClose, poisoned_receipt, release_all, withdraw_open
from ._fleet_gates import FleetGateReport, _Gate, fleet_metrics
from ._http import AsyncClosing

__all__ = ["OWNER_ENV", "FleetGateReport", "GateFleet"]

OWNER_ENV = "TOKCAP_OWNER"
"""The variable a fleet reads its owner from when none is given (else a random one)."""

_UNREACHABLE = "unreachable"  # the code ControlPlaneClient gives transport failures


class GateFleet(AsyncClosing):
    """Typed async client over gates at ``urls``; use as ``async with GateFleet(...)``.

    ``token`` is the fleet's control token (every gate's); ``path_prefix`` is the gates'
    ``--tokcap-path-prefix``; ``owner`` the fleet's owner token (module doc; default
    ``$TOKCAP_OWNER``, else a random one; a restarted trainer that passes its predecessor's
    owner takes its rollouts back at once, any other after the gates' lease). Other
    keyword arguments go to each `ControlPlaneClient`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        *,
        path_prefix: str = "/tokcap/rollouts/",
        owner: str | None = None,
        **client_options: Any,
    ) -> None:
        if not urls:
            raise ValueError("a fleet needs at least one gate url")
        self.path_prefix = path_prefix
        owner = owner or os.environ.get(OWNER_ENV) or f"fleet-{secrets.token_hex(8)}"
        self.owner = owner
        self._gates = [
            _Gate(
                url.rstrip("/"), ControlPlaneClient(url, token, owner=self.owner, **client_options)
            )
            for url in urls
        ]
        self._instance: dict[str, str] = {}
        """The gate instance each rollout was opened under."""
        self._restarted: set[str] = set()
        """Lost rollouts whose gate restarted (it answers: their release is still asked)."""
        self._owner: dict[str, _Gate] = {}
        self._lost: dict[str, str] = {}
        self._opening: dict[str, anyio.Event] = {}
        """Opens under way: a second open of the same id waits for the first one's answer."""

    def __repr__(self) -> str:
        return f"GateFleet({[g.url for g in self._gates]!r})"

    async def aclose(self) -> None:
        """Close every gate's connection pool."""
        for gate in self._gates:
            await gate.client.aclose()

    # ---- assignment ----------------------------------------------------------------------

    async def open(self, rollout_id: str) -> str:
        """Assign ``rollout_id`` to a gate, open it there; returns its OpenAI base URL.

        Opening an assigned rollout again returns the same URL, and so do opens of one id
        that race (the later ones wait for the first one's placement; they never open the
        rollout on a second gate). A gate that does not answer is marked lost and the next
        one tried; `ControlUnreachable` when none does. An open cut short (cancelled) after
        its request left closes and releases the rollout on that gate (`withdraw_open`).
        """
        validate_rollout_id(rollout_id)
        while (pending := self._opening.get(rollout_id)) is not None:
            await pending.wait()
        owner = self._owner.get(rollout_id)
        if owner is not None and rollout_id not in self._lost:
            return self._base_url(owner, rollout_id)
        done = self._opening[rollout_id] = anyio.Event()
        try:
            return await self._place(rollout_id)
        finally:
            del self._opening[rollout_id]
            done.set()

    async def _place(self, rollout_id: str) -> str:
        while True:
            live = [g for g in self._gates if g.alive]
            if not live:
                raise ControlUnreachable(_UNREACHABLE, "no gate of the fleet answers", 0)
            gate = min(live, key=lambda g: len(g.open))
            gate.open.add(rollout_id)  # counted before the await: concurrent opens spread
            try:
                opened = await gate.client.open(rollout_id)
            except ControlUnreachable as e:
                gate.open.discard(rollout_id)
                if e.code != _UNREACHABLE:
                    raise
                self._gate_lost(gate, e)
                continue
            except BaseException as e:
                gate.open.discard(rollout_id)
                if not isinstance(e, ControlPlaneError):  # cut short: it may be open there
                    await withdraw_open(gate.client, rollout_id)
                raise
            gate.opened += 1
            self._owner[rollout_id] = gate
            self._instance[rollout_id] = opened.instance
            self._lost.pop(rollout_id, None)
            self._restarted.discard(rollout_id)
            return self._base_url(gate, rollout_id)

    def base_url(self, rollout_id: str) -> str:
        """The OpenAI base URL of an opened rollout (on its gate)."""
        return self._base_url(self._gate_of(rollout_id), rollout_id)

    def gate_url(self, rollout_id: str) -> str:
        """The URL of the gate that owns ``rollout_id``."""
        return self._gate_of(rollout_id).url

    async def probe(self, url: str) -> bool:
        """Whether the gate at ``url`` still answers (``/tokcap/v1/health``; any HTTP answer
        counts). One that does not is marked lost now: its open rollouts are poisoned
        (``gate_unreachable``) and it gets no new rollout. A lost gate stays lost. What a
        trainer asks when a harness call or a weight push to that gate failed in transport."""
        gate = self._gate_at(url)
        if not gate.alive:
            return False
        try:
            await gate.client.health()
        except ControlUnreachable as e:
            if e.code == _UNREACHABLE:
                self._gate_lost(gate, e)
                return False
        except ControlPlaneError:
            pass  # it answers, if only to say it is down: not lost
        return True

    def lost(self) -> dict[str, str]:
        """``{rollout_id: reason}`` of rollouts poisoned because their gate stopped answering."""
        return dict(self._lost)

    def orphaned_keys(self, staged_keys: Iterable[str]) -> list[StagingKey]:
        """The keys among a sink's ``staged_keys()`` that lost rollouts left behind: no
        receipt names them, so the trainer clears them itself."""
        return [StagingKey(k) for k in staged_keys if k.split("/", 1)[0] in self._lost]

    # ---- routed control operations -------------------------------------------------------

    async def declare_terminal(
        self, rollout_id: str, *, call_id: str | None = None, response_id: str | None = None
    ) -> tuple[int, str]:
        """`ControlPlaneClient.declare_terminal` on the owning gate (a lost rollout: its
        genesis head)."""
        gate = self._gate_of(rollout_id)
        if rollout_id in self._lost:
            return (0, genesis_hash(rollout_id))
        try:
            return await gate.client.declare_terminal(
                rollout_id, call_id=call_id, response_id=response_id
            )
        except ControlUnreachable as e:
            return self._lost_head(gate, rollout_id, e)
        except (ControlNotFound, ControlConflict) as refused:
            return await self._restarted_head(gate, rollout_id, refused)

    async def manifest(self, rollout_id: str) -> Manifest:
        """`ControlPlaneClient.manifest` on the owning gate."""
        return await self._gate_of(rollout_id).client.manifest(rollout_id)

    async def close(self, rollout_id: str, **witnesses: Any) -> tuple[int, str]:
        """`ControlPlaneClient.close` on the owning gate; keep the head for `fetch_receipts`.

        If the gate does not answer, its rollouts are lost and this returns the genesis
        head (the receipt will be poisoned ``gate_unreachable``).
        """
        gate = self._gate_of(rollout_id)
        if rollout_id in self._lost:
            return (0, genesis_hash(rollout_id))
        try:
            head = await gate.client.close(rollout_id, **witnesses)
        except ControlUnreachable as e:
            return self._lost_head(gate, rollout_id, e)
        except (ControlNotFound, ControlConflict) as refused:
            return await self._restarted_head(gate, rollout_id, refused)
        gate.open.discard(rollout_id)
        gate.closed += 1
        return head

    async def close_many(
        self,
        closes: Sequence[RolloutClose],
        *,
        receipts: Literal["terminal", "all"] | None = None,
    ) -> list[CloseResult]:
        """`ControlPlaneClient.close_many` on every owning gate at once (one durable write per
        gate); one result per rollout, in order.

        A lost rollout, or one on a gate that stops answering now, gets the genesis head as
        in `close` (its receipt is poisoned ``gate_unreachable``: with ``receipts``, the
        result holds that receipt).
        """
        by_gate: dict[int, list[int]] = {}
        for index, c in enumerate(closes):
            by_gate.setdefault(id(self._gate_of(c.rollout_id)), []).append(index)
        out: list[CloseResult | None] = [None] * len(closes)

        async def one_gate(gate: _Gate, indexes: list[int]) -> None:
            asked = [i for i in indexes if closes[i].rollout_id not in self._lost]
            try:
                results = await gate.client.close_many(
                    [closes[i] for i in asked], receipts=receipts
                )
            except ControlUnreachable as gone:  # a left-out manifest's fetch found it gone
                if gone.code != _UNREACHABLE:
                    raise
                self._gate_lost(gate, gone, also=[closes[i].rollout_id for i in asked])
                results = []
            self._check_restart(gate)
            for index, result in zip(asked, results, strict=True):
                rid = result.rollout_id
                e = result.error
                if rid in self._restarted:
                    result = CloseResult(rollout_id=rid, head=(0, genesis_hash(rid)))
                elif isinstance(e, ControlUnreachable) and e.code == _UNREACHABLE:
                    result = CloseResult(rollout_id=rid, head=self._lost_head(gate, rid, e))
                elif result.ok:
                    gate.open.discard(rid)
                    gate.closed += 1
                out[index] = result
            for index in indexes:
                rid = closes[index].rollout_id
                result = out[index] or CloseResult(rollout_id=rid, head=(0, genesis_hash(rid)))
                if receipts is not None and result.receipt is None and rid in self._lost:
                    lost = poisoned_receipt(rid, self._lost[rid])
                    result = attrs.evolve(result, receipt=lost)
                out[index] = result

        async with anyio.create_task_group() as tg:
            for indexes in by_gate.values():
                tg.start_soon(one_gate, self._gate_of(closes[indexes[0]].rollout_id), indexes)
        return [r for r in out if r is not None]

    async def release_many(self, rollout_ids: Iterable[str]) -> None:
        """`release` every rollout, concurrently; the first error raises once all were tried."""
        await release_all(self.release, rollout_ids, 64)

    async def fetch_receipts(
        self,
        rollout_ids: Iterable[str],
        *,
        expected_heads: Mapping[str, tuple[int, str]] | None = None,
        segments: Literal["terminal", "all"] = "terminal",
    ) -> list[Receipt]:
        """One receipt per id, in order, fetched from every gate concurrently.

        Lost rollouts get a poisoned receipt (``gate_unreachable``) without a request; a
        gate that stops answering now loses its rollouts the same way. Other control-plane
        failures (auth) raise.
        """
        ids = [validate_rollout_id(r) for r in rollout_ids]
        heads = dict(expected_heads or {})
        found: dict[str, Receipt] = {}
        by_gate: dict[int, list[str]] = {}
        for rid in ids:
            gate = self._gate_of(rid)
            by_gate.setdefault(id(gate), []).append(rid)
        errors: list[ControlPlaneError] = []

        async def one_gate(gate: _Gate, rids: list[str]) -> None:
            asked = [r for r in rids if r not in self._lost]
            try:
                receipts = await gate.client.fetch_receipts(
                    asked,
                    expected_heads={r: heads[r] for r in asked if r in heads},
                    segments=segments,
                )
            except ControlUnreachable as e:
                if e.code != _UNREACHABLE:
                    errors.append(e)
                    return
                self._gate_lost(gate, e, also=asked)
                receipts = []
            except ControlPlaneError as e:
                errors.append(e)
                return
            self._check_restart(gate)
            found.update((r.rollout_id, r) for r in receipts if r.rollout_id not in self._restarted)

        async with anyio.create_task_group() as tg:
            for rids in by_gate.values():
                tg.start_soon(one_gate, self._gate_of(rids[0]), rids)
        if errors:
            raise errors[0]
        return [found.get(rid) or poisoned_receipt(rid, self._lost[rid]) for rid in ids]

    async def release(self, rollout_id: str) -> None:
        """Release on the owning gate and forget the assignment (a lost rollout: forgotten;
        on a restarted gate, released there too if that gate still holds it)."""
        gate = self._gate_of(rollout_id)
        if rollout_id in self._restarted:
            with contextlib.suppress(ControlPlaneError):  # the new instance may not know it
                await gate.client.release(rollout_id)
        elif rollout_id not in self._lost:
            try:
                await gate.client.release(rollout_id)
            except ControlUnreachable as e:
                if e.code != _UNREACHABLE:
                    raise
                self._gate_lost(gate, e)
            else:
                gate.released += 1
        gate.open.discard(rollout_id)
        del self._owner[rollout_id]
        self._instance.pop(rollout_id, None)
        self._restarted.discard(rollout_id)
        self._lost.pop(rollout_id, None)

    # ---- reports -------------------------------------------------------------------------

    def report(self) -> list[FleetGateReport]:
        """One report per gate, in the order given."""
        return [g.report() for g in self._gates]

    def metrics(self) -> dict[str, float]:
        """`report` as ``fleet/gate<i>/<field>`` floats, plus ``fleet/gates_alive``."""
        return fleet_metrics(self.report())

    # ---- internals -----------------------------------------------------------------------

    def _gate_of(self, rollout_id: str) -> _Gate:
        gate = self._owner.get(rollout_id)
        if gate is None:
            raise ControlNotFound(
                "unknown_rollout", f"{rollout_id} was not opened through this fleet", 404
            )
        return gate

    def _gate_at(self, url: str) -> _Gate:
        for gate in self._gates:
            if gate.url == url.rstrip("/"):
                return gate
        raise ValueError(f"{url} is not a gate of this fleet")

    def _base_url(self, gate: _Gate, rollout_id: str) -> str:
        return f"{gate.url}{self.path_prefix}{rollout_id}/v1"

    async def _restarted_head(
        self, gate: _Gate, rollout_id: str, refused: ControlPlaneError
    ) -> tuple[int, str]:
        """The genesis head if ``gate`` restarted since ``rollout_id`` opened there; else the
        gate's refusal stands."""
        self._check_restart(gate)
        if rollout_id in self._restarted:
            return (0, genesis_hash(rollout_id))
        raise refused

    def _lost_head(
        self, gate: _Gate, rollout_id: str, error: ControlUnreachable
    ) -> tuple[int, str]:
        if error.code != _UNREACHABLE:
            raise error
        self._gate_lost(gate, error)
        return (0, genesis_hash(rollout_id))

    def _check_restart(self, gate: _Gate) -> None:
        """Rollouts opened on an earlier instance of ``gate`` than the one that answered last
        are lost ``gate_restarted``."""
        now = gate.client.instance
        reason = make_reason(GATE_RESTARTED)
        for rid, gate_of in self._owner.items():
            was = self._instance.get(rid, "")
            if gate_of is gate and was and now and was != now and rid not in self._lost:
                self._lost[rid] = reason
                self._restarted.add(rid)
                gate.open.discard(rid)

    def _gate_lost(
        self, gate: _Gate, error: ControlUnreachable, *, also: Iterable[str] = ()
    ) -> None:
        """Mark ``gate`` lost: its open rollouts (and ``also``: closed ones whose receipts
        it can no longer serve) are poisoned; rollouts already receipted are not."""
        gate.alive = False
        reason = make_reason(GATE_UNREACHABLE, type(error.__cause__ or error).__name__)
        for rid in sorted({*gate.open, *also}):
            if rid not in self._lost:
                self._lost[rid] = reason
                gate.unreachable += 1
        gate.open.clear()
