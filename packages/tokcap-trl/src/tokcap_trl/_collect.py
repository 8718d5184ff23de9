"""The collection layer every TRL path shares: plan → play → close → verify → rows → release.

`Collector.collect` takes rollouts to play (`RolloutPlan`: an id, a group, a prompt) and a
harness, and returns one `Collected` per plan, in order, never fewer:

1. **open** each rollout on a gate of the fleet (`tokcap_vllm.GateFleet.open`: the live
   gate with the fewest open rollouts; gates run ``--tokcap-require-open`` refuse
   rollouts opened elsewhere);
2. **play**: the harness gets an ``openai.AsyncOpenAI`` client on the rollout's URL (all
   clients share one connection pool), at most ``concurrency`` at a time. A harness that
   raises invalidates its own rollout only (``harness_failed:<type>``); a transport error
   makes the fleet probe that gate (a dead gate poisons its own open rollouts,
   ``gate_unreachable``);
3. **close** every rollout with its reward and witness in one batch per gate (one durable
   ledger write each), and verify each receipt against the head its close returned;
4. **rows**: fetch the verified receipts' staged calls from the sink in one batch and
   rebuild each rollout's row with `tokcap_core.reassemble` (every digest and chain hash
   checked); one row per rollout (the terminal segment);
5. **free**: clear every staged call the batch left in the sink, release every rollout on
   its gate; on failure or cancellation too (shielded), so nothing stays held.

A rollout that is not valid (poisoned receipt, rows that do not verify, a failed close or
harness) still gets its `Collected`, with a placeholder row (``sample_mask == 0``) and the
reason; each one is logged (logger ``tokcap_trl``) and counted in the batch's metrics.
Nothing is dropped silently.

`Collector` is safe to use from several tasks at once on one event loop (one call per
group, say): each call owns its rollouts. This module imports neither TRL nor torch: the
GRPOTrainer adapter (`tokcap_trl.GRPORollouts`) and other workers build on it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import anyio
import attrs
import openai

from tokcap_core import (
    MissingRows,
    ReassemblyError,
    Receipt,
    TokenSink,
    TrainingRow,
    placeholder_row,
    reassemble,
)
from tokcap_core.ids import StagingKey
from tokcap_core.reasons import MISSING_ROWS, REASSEMBLY_FAILED, make_reason, reason_bucket
from tokcap_vllm import ControlPlaneError, GateFleet, RolloutClose

from ._harness import Episode, Harness, Prompt, Scored

__all__ = [
    "CLOSE_FAILED",
    "HARNESS_FAILED",
    "Collected",
    "CollectedBatch",
    "Collector",
    "RolloutPlan",
]

log = logging.getLogger("tokcap_trl")

HARNESS_FAILED = "harness_failed"
"""A rollout's reason prefix when its harness raised (the rollout is not trained: it has
no score to trust). Not a custody failure, so not one of `tokcap_core.reasons`' buckets."""
CLOSE_FAILED = "close_failed"
"""A rollout's reason prefix when its gate answered its close with an error (detail: the
error's code): no durable head, so no receipt to verify."""


@attrs.frozen(kw_only=True)
class RolloutPlan:
    """A rollout to play: its id (unique among the gates' live rollouts), group, prompt."""

    rollout_id: str
    group_id: str
    prompt: Prompt


@attrs.frozen(kw_only=True)
class Collected:
    """One planned rollout after collection: its verified row, or a placeholder and why."""

    rollout_id: str
    group_id: str
    index: int
    """Its position among the plans."""
    gate_url: str
    """The gate it was played on."""
    row: TrainingRow
    """The engine's exact tokens (``sample_mask == 1``), or a placeholder (0) with a reason."""
    receipt: Receipt | None
    """The verified (or poisoned) receipt; None if the close failed."""
    harness_error: str | None = None
    """``"<Type>: <message>"`` when the harness raised."""

    @property
    def valid(self) -> bool:
        """Whether the row may be trained on (verified receipt, verified rows, a score)."""
        return self.row.sample_mask == 1

    @property
    def reason(self) -> str | None:
        """Why it is not valid (None when it is)."""
        return self.row.reason

    @property
    def reward(self) -> float | None:
        """The reward the verified receipt carries (the ledger's, not the harness's copy);
        None when the rollout is not valid."""
        return self.row.reward if self.valid else None


@attrs.frozen(kw_only=True)
class CollectedBatch:
    """What `Collector.collect` returns: one `Collected` per plan, in order, and metrics."""

    rollouts: list[Collected]
    metrics: dict[str, float]
    """``tokcap/...`` counts (rollouts, valid, verified, invalid by reason bucket) and
    seconds per stage, ready for any logger."""

    @property
    def valid(self) -> list[Collected]:
        """The valid rollouts, in order."""
        return [c for c in self.rollouts if c.valid]

    @property
    def invalid(self) -> list[Collected]:
        """The rollouts that will not train, in order, each with its reason."""
        return [c for c in self.rollouts if not c.valid]


@attrs.define
class _Played:
    plan: RolloutPlan
    url: str = ""
    gate: str = ""
    scored: Scored | None = None
    error: str | None = None
    closed: bool = False


class Collector:
    """Plays planned rollouts through ``fleet`` and collects their verified rows from
    ``sink`` (see the module). ``model`` is the name requests carry; ``max_seq_len`` caps
    a row (longer ones are cut and marked truncated); ``concurrency`` bounds the harnesses
    playing at once. The caller owns ``fleet`` and ``sink`` and closes them."""

    def __init__(
        self,
        fleet: GateFleet,
        sink: TokenSink,
        *,
        model: str,
        max_seq_len: int,
        concurrency: int = 64,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        self.fleet = fleet
        self.sink = sink
        self.model = model
        self.max_seq_len = max_seq_len
        self.concurrency = concurrency

    async def collect(self, plans: Sequence[RolloutPlan], harness: Harness) -> CollectedBatch:
        """Play, close, verify and rebuild every plan's rollout; free all it left behind."""
        ids = [p.rollout_id for p in plans]
        if len(set(ids)) != len(ids):
            raise ValueError("a rollout id is planned more than once")
        played = [_Played(plan) for plan in plans]
        receipts: dict[str, Receipt] = {}
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            await self._open(played)
            await self._play(played, harness)
            t1 = time.perf_counter()
            close_errors = await self._close(played, receipts)
            t2 = time.perf_counter()
            rows = await self._rows(receipts)
            timings = {"play_s": t1 - t0, "close_s": t2 - t1, "rows_s": time.perf_counter() - t2}
        finally:
            t3 = time.perf_counter()
            with anyio.CancelScope(shield=True):
                await self._free(played, receipts)
            timings["free_s"] = time.perf_counter() - t3
        out = [
            self._collected(i, p, receipts.get(p.plan.rollout_id), rows, close_errors)
            for i, p in enumerate(played)
        ]
        for c in out:
            if not c.valid:
                log.warning(
                    "rollout %s (group %s) will not train: %s", c.rollout_id, c.group_id, c.reason
                )
        return CollectedBatch(rollouts=out, metrics=_metrics(out, timings))

    # ---- the stages ----------------------------------------------------------------------

    async def _open(self, played: list[_Played]) -> None:
        async def one(p: _Played) -> None:
            p.url = await self.fleet.open(p.plan.rollout_id)
            p.gate = self.fleet.gate_url(p.plan.rollout_id)

        async with anyio.create_task_group() as tg:
            for p in played:
                tg.start_soon(one, p)

    async def _play(self, played: list[_Played], harness: Harness) -> None:
        limit = anyio.Semaphore(self.concurrency)

        async def one(http: openai.DefaultAsyncHttpxClient, index: int, p: _Played) -> None:
            episode = Episode(
                rollout_id=p.plan.rollout_id,
                group_id=p.plan.group_id,
                index=index,
                prompt=p.plan.prompt,
                model=self.model,
                base_url=p.url,
            )
            client = openai.AsyncOpenAI(
                base_url=p.url, api_key="unused", max_retries=0, http_client=http
            )
            async with limit:
                try:
                    outcome = await harness(client, episode)
                    p.scored = outcome if isinstance(outcome, Scored) else Scored(reward=outcome)
                except Exception as e:  # the harness's failure is its rollout's alone
                    p.error = f"{type(e).__name__}: {e}"
                    if isinstance(e, openai.APIConnectionError):
                        await self.fleet.probe(self.fleet.gate_url(p.plan.rollout_id))

        async with openai.DefaultAsyncHttpxClient() as http, anyio.create_task_group() as tg:
            for index, p in enumerate(played):
                tg.start_soon(one, http, index, p)

    async def _close(self, played: list[_Played], receipts: dict[str, Receipt]) -> dict[str, str]:
        """Close all (harness failures with no reward); receipts of the durable closes,
        verified against their heads; ``{rollout_id: reason}`` of closes that failed."""
        closes = [
            RolloutClose(
                rollout_id=p.plan.rollout_id,
                reward=p.scored.reward if p.scored is not None else None,
                response_id=p.scored.response_id if p.scored is not None else None,
                content=p.scored.content if p.scored is not None else None,
            )
            for p in played
        ]
        results = await self.fleet.close_many(closes, receipts="terminal")
        failed: dict[str, str] = {}
        heads: dict[str, tuple[int, str]] = {}
        for p, result in zip(played, results, strict=True):
            p.closed = True
            if result.error is not None:
                failed[result.rollout_id] = f"{CLOSE_FAILED}:{result.error.code}"
            elif result.receipt is not None:
                receipts[result.rollout_id] = result.receipt
            else:
                heads[result.rollout_id] = result.head_or_raise()
        if heads:
            fetched = await self.fleet.fetch_receipts(list(heads), expected_heads=heads)
            receipts.update((r.rollout_id, r) for r in fetched)
        return failed

    async def _rows(self, receipts: dict[str, Receipt]) -> dict[str, TrainingRow | str]:
        """Each verified receipt's row, or the reason it has none."""
        verified = [r for r in receipts.values() if r.ok]
        keys = [call.staging_key for r in verified for call in r.segments[0]]
        try:
            staged = dict(zip(keys, await self.sink.get(keys), strict=True))
        except MissingRows as e:  # some rows are gone: fetch the others rollout by rollout
            missing = set(e.missing)
            present = [k for k in keys if k not in missing]
            staged = dict(zip(present, await self.sink.get(present), strict=True))
        out: dict[str, TrainingRow | str] = {}
        for receipt in verified:
            try:
                out[receipt.rollout_id] = reassemble(receipt, staged, max_seq_len=self.max_seq_len)[
                    0
                ]
            except ReassemblyError as e:
                out[receipt.rollout_id] = (
                    MISSING_ROWS
                    if e.code == "missing_call"
                    else make_reason(REASSEMBLY_FAILED, e.code)
                )
        return out

    async def _free(self, played: list[_Played], receipts: dict[str, Receipt]) -> None:
        """Leave nothing held: rollouts never closed (a failure above) are closed without a
        reward, every staged call of the batch is cleared, every rollout released."""
        opened = [p for p in played if p.url]
        mine = {p.plan.rollout_id for p in opened}
        unclosed = [p.plan.rollout_id for p in opened if not p.closed]
        for rollout_id in unclosed:
            with contextlib.suppress(ControlPlaneError):
                await self.fleet.close(rollout_id)
        keys: list[StagingKey] = [k for r in receipts.values() for k in r.sink_keys]
        if unclosed or self.fleet.lost():
            # no receipt names these: find them by rollout id
            keys += [k for k in await self.sink.staged_keys() if k.split("/", 1)[0] in mine]
        if keys:
            await self.sink.clear(sorted(set(keys)))
        await self.fleet.release_many(sorted(mine))

    # ---- results -------------------------------------------------------------------------

    def _collected(
        self,
        index: int,
        p: _Played,
        receipt: Receipt | None,
        rows: dict[str, TrainingRow | str],
        close_errors: dict[str, str],
    ) -> Collected:
        rid = p.plan.rollout_id
        reward = p.scored.reward if p.scored is not None else None
        row: TrainingRow | str
        if rid in close_errors:
            row = close_errors[rid]
        elif receipt is None or not receipt.ok:
            row = (receipt.failure_reason if receipt is not None else None) or MISSING_ROWS
        elif p.error is not None:
            row = f"{HARNESS_FAILED}:{p.error.split(':', 1)[0]}"
        else:
            row = rows[rid]
        if isinstance(row, str):
            row = placeholder_row(rid, row, reward=reward)
        return Collected(
            rollout_id=rid,
            group_id=p.plan.group_id,
            index=index,
            gate_url=p.gate,
            row=row,
            receipt=receipt,
            harness_error=p.error,
        )


def _metrics(rollouts: Sequence[Collected], timings: dict[str, float]) -> dict[str, float]:
    out = {
        "tokcap/rollouts": float(len(rollouts)),
        "tokcap/valid": float(sum(c.valid for c in rollouts)),
        "tokcap/receipts_verified": float(
            sum(c.receipt is not None and c.receipt.ok for c in rollouts)
        ),
        "tokcap/invalid": float(sum(not c.valid for c in rollouts)),
    }
    for c in rollouts:
        if c.reason is not None:
            bucket = c.reason.split(":", 1)[0]
            if bucket not in (HARNESS_FAILED, CLOSE_FAILED):
                bucket = reason_bucket(c.reason)
            key = f"tokcap/invalid/{bucket}"
            out[key] = out.get(key, 0.0) + 1.0
    out.update({f"tokcap/time/{name}": seconds for name, seconds in timings.items()})
    return out
