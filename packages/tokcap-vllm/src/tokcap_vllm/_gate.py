"""The gate: the open and closed rollouts of one vLLM server, their ledgers, and staging.

Per captured call: `admit` (resolve the parent, append ``Admitted``) → the engine runs on
the admitted ids (`CaptureHost`) → `engine_finished` starts the sink write at once → the
middleware reports the response complete (`response_complete`) → a background task
commits ``Staged`` once the sink acknowledged, or ``Failed(served=True)`` if it did not.
A call whose response never completed is `abandon`-ed: ``Failed(served=False)`` and its
staged row (if any) cleared. A child waits for its parent's commit before it is admitted.

The control plane (`ControlPlane`) is a thin HTTP layer over `ledger`, `declare_terminal`,
`close`, `release` and `rollouts`. Observers (`GateHooks`: the ledger file, Prometheus
metrics) see every appended entry; with ``GateConfig.ledger_path`` the gate replays its
ledger file when built, and rollouts that were open at a crash are poisoned
(``gate_restarted``), never resumed.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from tokcap_core import Entry, Ledger, MemorySink, StagedCall, TokcapError, TokenSink
from tokcap_core.ids import validate_rollout_id
from tokcap_core.ledger import (
    Admitted,
    Closed,
    Failed,
    Poisoned,
    Staged,
    TerminalDeclared,
    Witnesses,
)
from tokcap_core.reasons import GATE_RESTARTED, STAGE_FAILED, UNCOMMITTED_CALL, make_reason

from ._admission import ChatPlan, PriorCall
from ._config import GateConfig
from ._errors import RolloutConflict, RolloutNotFound
from ._hooks import GateHooks
from ._host import EngineResult
from ._persist import LedgerFile
from ._prom import GateMetrics

__all__ = ["Gate", "PendingCall"]

CallPhase = Literal["admitted", "finished", "responded", "committed", "failed"]


@dataclass(slots=True, eq=False)
class PendingCall:
    """The gate's working record of one captured call (tokens live here until committed)."""

    rollout_id: str
    call_id: str
    kind: str
    plan: ChatPlan
    parent_chain_hash: str | None
    request_messages: list[dict[str, Any]] | None
    idempotency_key: str | None
    phase: CallPhase = "admitted"
    result: EngineResult | None = None
    staged: StagedCall | None = None
    stage_error: str | None = None
    prior: PriorCall | None = None
    response_id: str | None = None
    output_fp: str | None = None
    replay: tuple[dict[str, Any], list[bytes]] | None = None
    sink_done: anyio.Event = field(default_factory=anyio.Event)
    settled: anyio.Event = field(default_factory=anyio.Event)

    @property
    def committed(self) -> bool:
        """Whether the call's ``Staged`` entry is in the ledger."""
        return self.phase == "committed"


class _HookedLedger(Ledger):
    """A ledger that tells the gate's hooks about every entry it appends (part 2)."""

    __slots__ = ("hooks",)

    def __init__(self, rollout_id: str, hooks: list[GateHooks] | None = None) -> None:
        super().__init__(rollout_id)
        self.hooks: list[GateHooks] = hooks if hooks is not None else []

    def append(self, event: Any) -> Entry:
        entry = super().append(event)
        for hook in self.hooks:
            hook.on_entry(self.rollout_id, entry)
        return entry


@dataclass(slots=True, eq=False)
class _Rollout:
    ledger: Ledger
    calls: dict[str, PendingCall] = field(default_factory=dict)
    priors: list[PriorCall] = field(default_factory=list)
    gen_starts: dict[str, int] = field(default_factory=dict)
    by_key: dict[str, PendingCall] = field(default_factory=dict)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    served_failure: bool = False


class Gate:
    """Holds every rollout this server captures; serves their ledgers in-process."""

    def __init__(self, config: GateConfig | None = None, *, sink: TokenSink | None = None) -> None:
        self.config = config or GateConfig()
        self.sink: TokenSink = sink if sink is not None else MemorySink()
        self._open: dict[str, _Rollout] = {}
        self._closed: dict[str, Ledger] = {}
        self._tg: TaskGroup | None = None
        self._counts: Counter[str] = Counter()
        # ---- part 2: observers and the ledger file ----
        self._hooks: list[GateHooks] = []
        self.prometheus = GateMetrics(self)
        self.attach(self.prometheus)
        self.ledger_file: LedgerFile | None = None
        if self.config.ledger_path is not None:
            self.ledger_file, stored = LedgerFile.open(
                self.config.ledger_path,
                compact_after_releases=self.config.compact_after_releases,
            )
            self.attach(self.ledger_file)
            self.restore(stored)
            self.ledger_file.sync_blocking()

    # ---- lifecycle -------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the background staging tasks until cancelled (``await tg.start(gate.serve)``)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    @property
    def running(self) -> bool:
        """Whether `serve` is running (captured calls need it)."""
        return self._tg is not None

    # ---- the in-process API (part 2 wraps this in HTTP) --------------------------------

    def ledger(self, rollout_id: str) -> Ledger:
        """The ledger of an open or closed rollout; `RolloutNotFound` otherwise."""
        validate_rollout_id(rollout_id)
        if rollout_id in self._open:
            return self._open[rollout_id].ledger
        if rollout_id in self._closed:
            return self._closed[rollout_id]
        raise RolloutNotFound("unknown_rollout", f"no rollout {rollout_id}")

    def rollouts(self) -> dict[str, str]:
        """Every rollout held, ``{rollout_id: "open" | "closed"}``."""
        return {**{r: "closed" for r in self._closed}, **{r: "open" for r in self._open}}

    def declare_terminal(
        self, rollout_id: str, *, call_id: str | None = None, response_id: str | None = None
    ) -> Entry:
        """Name the rollout's terminal call (by call id or by response id)."""
        if (call_id is None) == (response_id is None):
            raise ValueError("give exactly one of call_id, response_id")
        rollout = self._open_rollout(rollout_id)
        if call_id is not None:
            return rollout.ledger.append(TerminalDeclared(by="call_id", value=call_id))
        return rollout.ledger.append(TerminalDeclared(by="response_id", value=response_id or ""))

    async def close(
        self, rollout_id: str, reward: float | None, witnesses: Witnesses | None = None
    ) -> tuple[int, str]:
        """Wait for in-flight commits, append ``Closed`` and return the ledger head."""
        rollout = self._open_rollout(rollout_id)
        await self.drain(rollout_id)
        rollout.ledger.append(Closed(reward=reward, witnesses=witnesses or Witnesses()))
        self._closed[rollout_id] = rollout.ledger
        del self._open[rollout_id]
        for hook in self._hooks:  # part 2: the head is returned once it is durable
            await hook.on_close(rollout_id)
        return rollout.ledger.head

    def release(self, rollout_id: str) -> None:
        """Forget a closed rollout (its manifest is no longer served)."""
        if self._closed.pop(rollout_id, None) is None:
            raise RolloutNotFound("unknown_rollout", f"no closed rollout {rollout_id}")
        for hook in self._hooks:
            hook.on_release(rollout_id)

    async def drain(self, rollout_id: str | None = None) -> None:
        """Wait until every call that finished on the engine is committed or failed."""
        rollouts = [self._open[rollout_id]] if rollout_id is not None else list(self._open.values())
        for rollout in rollouts:
            for call in list(rollout.calls.values()):
                if call.phase in ("finished", "responded"):
                    await call.settled.wait()

    def staged_call(self, rollout_id: str, call_id: str) -> StagedCall | None:
        """The staged call the gate built for a call (None if it never finished)."""
        rollout = self._open.get(rollout_id)
        call = rollout.calls.get(call_id) if rollout else None
        return call.staged if call else None

    def metrics(self) -> dict[str, float]:
        """Counters ready for any logger: calls by outcome, breaks by cause, rollouts."""
        out = {f"tokcap/{k}": float(v) for k, v in sorted(self._counts.items())}
        out["tokcap/rollouts_open"] = float(len(self._open))
        out["tokcap/rollouts_closed"] = float(len(self._closed))
        return out

    # ---- part 2: observers, restore after a restart ------------------------------------

    def attach(self, hooks: GateHooks) -> None:
        """Add an observer of every entry, staging write, close and release."""
        self._hooks.append(hooks)

    def held_ledgers(self) -> list[Ledger]:
        """Every ledger held, open and closed (what a ledger-file compaction keeps)."""
        return [*self._closed.values(), *(r.ledger for r in self._open.values())]

    def restore(self, ledgers: Iterable[Ledger]) -> list[str]:
        """Take back stored ledgers after a restart; return the ids poisoned on the way.

        A closed ledger is served as it was. One that was still open is poisoned with
        ``Poisoned(gate_restarted)`` (appended, so the hooks persist it) and held as
        closed: its in-flight calls are gone, so it is never resumed.
        """
        poisoned = []
        for stored in ledgers:
            ledger = _HookedLedger.from_entries(stored.rollout_id, stored.entries)
            assert isinstance(ledger, _HookedLedger)
            ledger.hooks = self._hooks
            if ledger.state.closed is None and ledger.state.poisoned is None:
                ledger.append(Poisoned(reason=make_reason(GATE_RESTARTED)))
                poisoned.append(ledger.rollout_id)
                self._counts["rollouts_poisoned/gate_restarted"] += 1
            self._closed[ledger.rollout_id] = ledger
        return poisoned

    # ---- the capture path (used by the middleware and the host) -----------------------

    def _open_rollout(self, rollout_id: str) -> _Rollout:
        validate_rollout_id(rollout_id)
        rollout = self._open.get(rollout_id)
        if rollout is None:
            if rollout_id in self._closed:
                raise RolloutConflict("rollout_closed", f"{rollout_id} is closed")
            raise RolloutNotFound("unknown_rollout", f"no open rollout {rollout_id}")
        return rollout

    def rollout_for_call(self, rollout_id: str) -> _Rollout | None:
        """The open rollout a new call joins (created on first use); None if served uncaptured."""
        if rollout_id in self._closed:
            raise RolloutConflict(
                "rollout_closed", f"{rollout_id} is closed; start a new rollout id"
            )
        rollout = self._open.get(rollout_id)
        if rollout is None:
            rollout = self._open[rollout_id] = _Rollout(
                ledger=_HookedLedger(rollout_id, self._hooks)
            )
        if rollout.served_failure:
            self._counts["calls_uncaptured_after_failure"] += 1
            return None
        return rollout

    def replay_of(self, rollout: _Rollout, key: str | None) -> PendingCall | None:
        """An earlier call with the same idempotency key (committed or still in flight)."""
        if key is None:
            return None
        call = rollout.by_key.get(key)
        if call is None or call.phase == "failed":
            return None
        return call

    async def admit(
        self,
        rollout: _Rollout,
        plan_fn: Any,
        *,
        kind: str,
        messages: list[dict[str, Any]] | None,
        idempotency_key: str | None,
    ) -> PendingCall:
        """Plan (``plan_fn(priors, gen_starts) -> ChatPlan``, run in a thread) and admit a call.

        The plan is made under the rollout's lock; if its parent has not committed yet the
        lock is released, the parent awaited (bounded), and the plan made again.
        """
        while True:
            async with rollout.lock:
                priors = list(rollout.priors)
                plan: ChatPlan = await anyio.to_thread.run_sync(
                    plan_fn, priors, dict(rollout.gen_starts)
                )
                parent = rollout.calls.get(plan.parent_id) if plan.parent_id else None
                if parent is None or parent.phase == "committed":
                    return self._append_admitted(
                        rollout, plan, parent, kind, messages, idempotency_key
                    )
            with anyio.move_on_after(self.config.parent_commit_timeout_s):
                await parent.settled.wait()
            if not parent.committed:
                raise RolloutConflict(
                    "parent_not_committed", f"parent {parent.call_id} did not commit"
                )

    def _append_admitted(
        self,
        rollout: _Rollout,
        plan: ChatPlan,
        parent: PendingCall | None,
        kind: str,
        messages: list[dict[str, Any]] | None,
        key: str | None,
    ) -> PendingCall:
        call_id = rollout.ledger.next_call_id()
        rollout.ledger.append(
            Admitted(
                call_id=call_id,
                parent_id=plan.parent_id,
                prefix_len=plan.prefix_len,
                admitted_at=time.time_ns(),
                request_fingerprint=plan.request_fingerprint,
                break_cause=plan.break_cause,
            )
        )
        self._counts["calls_admitted"] += 1
        if plan.break_cause is not None:
            self._counts[f"breaks/{plan.break_cause}"] += 1
        chain = (
            parent.staged.chain_hash if parent is not None and parent.staged is not None else None
        )
        call = PendingCall(
            rollout_id=rollout.ledger.rollout_id,
            call_id=call_id,
            kind=kind,
            plan=plan,
            parent_chain_hash=chain,
            request_messages=messages,
            idempotency_key=key,
        )
        rollout.calls[call_id] = call
        if key is not None:
            rollout.by_key[key] = call
        return call

    def engine_finished(self, call: PendingCall, result: EngineResult) -> None:
        """The engine produced the final output: build the staged call and start the sink write."""
        call.result = result
        call.phase = "finished"
        try:
            if result.finish_reason not in ("stop", "length") or not result.output_ids:
                raise TokcapError("engine_incomplete", f"finish_reason={result.finish_reason!r}")
            if any(map(math.isnan, result.logprobs)):
                raise TokcapError("bad_logprobs", "NaN logprob")
            call.staged = StagedCall.from_engine_output(
                rollout_id=call.rollout_id,
                call_id=call.call_id,
                parent_id=call.plan.parent_id,
                parent_cum_len=call.plan.prefix_len,
                parent_chain_hash=call.parent_chain_hash,
                prompt_ids=result.prompt_ids,
                output_ids=result.output_ids,
                logprobs=result.logprobs,
                finish_reason=result.finish_reason or "",
                weight_version=result.weight_version,
                routes=result.routes,
            )
        except TokcapError as e:
            call.stage_error = e.code
            call.sink_done.set()
            return
        assert self._tg is not None, "Gate.serve is not running"
        self._tg.start_soon(self._stage, call)

    async def _stage(self, call: PendingCall) -> None:
        assert call.staged is not None
        started = time.perf_counter()
        try:
            with anyio.fail_after(self.config.stage_timeout_s):
                await self.sink.put([call.staged])
        except TimeoutError:
            call.stage_error = "timeout"
        except Exception as e:  # the sink's failure is recorded for this rollout alone
            call.stage_error = getattr(e, "code", None) or type(e).__name__
        finally:
            call.sink_done.set()
            for hook in self._hooks:  # part 2: metrics
                hook.on_sink_write(call.staged, time.perf_counter() - started, call.stage_error)

    def response_complete(
        self,
        call: PendingCall,
        *,
        response_id: str | None,
        output_fp: str | None,
        cum_text: str | None,
        conversation_fp: str | None,
    ) -> None:
        """The harness got the whole response: index the call as a parent, commit it later."""
        call.phase = "responded"
        call.response_id = response_id
        call.output_fp = output_fp
        rollout = self._open.get(call.rollout_id)
        if (
            rollout is not None
            and call.staged is not None
            and cum_text is not None
            and call.result is not None
        ):
            cum_ids = array("I", call.result.prompt_ids)
            cum_ids.extend(call.result.output_ids)
            prior = PriorCall(call.call_id, call.kind, cum_text, cum_ids, conversation_fp)
            call.prior = prior
            rollout.priors.append(prior)
            rollout.gen_starts[call.call_id] = len(call.plan.prompt_text)
        assert self._tg is not None, "Gate.serve is not running"
        self._tg.start_soon(self._commit, call)

    async def _commit(self, call: PendingCall) -> None:
        await call.sink_done.wait()
        rollout = self._open.get(call.rollout_id)
        try:
            if rollout is None:
                return
            if call.stage_error is None and call.staged is not None:
                staged = call.staged
                rollout.ledger.append(
                    Staged(
                        call_id=call.call_id,
                        carry_len=staged.carry_len,
                        gen_len=staged.gen_len,
                        weight_version=staged.weight_version,
                        finish_reason=staged.finish_reason,
                        call_digest=staged.digest,
                        chain_hash=staged.chain_hash,
                        response_id=call.response_id,
                        output_fingerprint=call.output_fp,
                    )
                )
                call.phase = "committed"
                self._counts["calls_staged"] += 1
                return
            self._fail(rollout, call, make_reason(STAGE_FAILED, call.stage_error), served=True)
        finally:
            call.settled.set()

    def _fail(self, rollout: _Rollout, call: PendingCall, reason: str, *, served: bool) -> None:
        call.phase = "failed"
        if call.prior is not None and call.prior in rollout.priors:
            rollout.priors.remove(call.prior)
        rollout.ledger.append(Failed(call_id=call.call_id, reason=reason, served=served))
        self._counts[f"calls_failed/{'served' if served else 'unserved'}"] += 1
        if served:
            rollout.served_failure = True

    async def abandon(self, call: PendingCall, detail: str) -> None:
        """The response never completed: ``Failed(served=False)``, and clear any staged row."""
        rollout = self._open.get(call.rollout_id)
        if call.phase in ("committed", "failed", "responded"):
            return
        with anyio.CancelScope(shield=True):
            if call.phase == "finished":
                await call.sink_done.wait()
                if call.stage_error is None and call.staged is not None:
                    try:
                        await self.sink.clear([call.staged.key])
                    except Exception:  # best effort: the key is named by no receipt
                        self._counts["abandoned_clear_failed"] += 1
            if rollout is not None:
                self._fail(rollout, call, make_reason(UNCOMMITTED_CALL, detail), served=False)
            call.settled.set()
