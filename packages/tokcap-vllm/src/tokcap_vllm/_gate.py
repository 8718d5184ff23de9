"""The gate: captures every call of its rollouts, and keeps each failure inside its rollout.

Per captured request (see `tokcap_vllm._lifecycle` for the phases): `begin` joins the
rollout; `claim` holds its idempotency key and request id (or finds the earlier call to
replay); `admit` resolves the parent and appends ``Admitted``; the engine runs on the
admitted ids (`CaptureHost`); `engine_finished` starts the sink write at once;
`response_complete` (just before the response's last byte) makes the call a parent and
schedules its commit, which appends ``Staged`` once the sink acknowledged, or
``Failed(served=True)`` if it did not. A request refused before admission is `drop`-ped; a
call whose response never completed is `abandon`-ed (``Failed(served=False)``, its staged
row cleared).

Containment: nothing that goes wrong with one call reaches the task group `serve` runs.
A sink failure, a ledger refusal (``ledger_refused``) or an unexpected error
(``gate_failed``) fails that call and poisons its rollout; a ledger-file write failure
(``ledger_write_failed``) poisons its rollout (``Poisoned`` at close); each is logged
with its code and counted. Every other rollout goes on capturing.

The control operations (`declare_terminal`, `close`, `release`) are what the control
plane (`ControlPlane`) serves over HTTP. With ``GateConfig.ledger_path`` the gate
replays its ledger file when built; rollouts that were open at a crash are poisoned
(``gate_restarted``), never resumed.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from tokcap_core import Entry, Ledger, LedgerProtocolError, MemorySink, StagedCall, TokcapError
from tokcap_core.ids import CallId, RolloutId
from tokcap_core.ledger import (
    OPEN,
    Admitted,
    Closed,
    Event,
    Failed,
    Poisoned,
    Staged,
    TerminalDeclared,
    Witnesses,
)
from tokcap_core.reasons import (
    GATE_FAILED,
    GATE_RESTARTED,
    LEDGER_REFUSED,
    LEDGER_WRITE_FAILED,
    STAGE_FAILED,
    UNCOMMITTED_CALL,
    make_reason,
)
from tokcap_core.sink import TokenSink

from ._admission import ChatPlan, PriorCall
from ._config import GateConfig
from ._errors import RolloutConflict, WeightsUnavailable
from ._hooks import GateHooks
from ._host import EngineResult
from ._lifecycle import (
    ABANDONED,
    COMMITTED,
    DROPPED,
    FAILED,
    FINISHED,
    PLANNING,
    RESPONDED,
    GateCall,
)
from ._metrics import GateMetrics
from ._persist import LedgerFile, LedgerFileError
from ._registry import RolloutRecord, RolloutRegistry
from ._weight_state import WeightPhase, WeightState

if TYPE_CHECKING:
    from ._weights import WeightSync

__all__ = ["Gate", "GateHealth"]

_log = logging.getLogger("tokcap_vllm.gate")

Planner = Callable[[list[PriorCall], dict[CallId, int]], ChatPlan]
"""``plan(priors, gen_starts) -> ChatPlan``: resolves the parent and forms the prompt."""


class GateHealth:
    """What ``GET /tokcap/v1/health`` reports: ``ok``, ``degraded`` or ``down``."""

    __slots__ = ("ledger_problem", "rollouts_closed", "rollouts_open", "serving")

    def __init__(
        self, *, serving: bool, rollouts_open: int, rollouts_closed: int, ledger_problem: str | None
    ) -> None:
        self.serving = serving
        self.rollouts_open = rollouts_open
        self.rollouts_closed = rollouts_closed
        self.ledger_problem = ledger_problem

    @property
    def status(self) -> str:
        """``down`` when the gate is not serving, ``degraded`` when its ledger file has a
        problem, else ``ok``."""
        if not self.serving:
            return "down"
        return "degraded" if self.ledger_problem is not None else "ok"


class Gate:
    """Holds every rollout this server captures, stages their calls and serves their ledgers."""

    def __init__(self, config: GateConfig | None = None, *, sink: TokenSink | None = None) -> None:
        self.config = config or GateConfig()
        self.sink: TokenSink = sink if sink is not None else MemorySink()
        self.registry = RolloutRegistry(max_open=self.config.max_open_rollouts)
        self.telemetry = GateMetrics(self.registry.counts)
        self._observers: list[GateHooks] = [self.telemetry]
        self._tg: TaskGroup | None = None
        self._weights: WeightState | None = None
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

    def attach(self, hooks: GateHooks) -> None:
        """Add an observer of every entry, staging write, close and release."""
        self._observers.append(hooks)

    def watch_weights(self, sync: WeightSync) -> Callable[[], None]:
        """Follow ``sync``'s weight state (call on the server's loop); returns an unwatch function.

        While a push that failed after the pause leaves the weights FAILED (the engine may
        hold a half-updated model), every captured call is refused before admission with
        `WeightsUnavailable` (503, ``weights_unavailable``) until a full push succeeds.
        During PUSHING calls are admitted: the engine queues them and generates them on the
        new weights once the push resumes it.
        """
        self._weights = sync.state

        def follow(state: WeightState) -> None:
            self._weights = state

        unsubscribe = sync.subscribe(follow)

        def unwatch() -> None:
            unsubscribe()
            self._weights = None

        return unwatch

    # ---- reading ---------------------------------------------------------------------

    def ledger(self, rollout_id: str) -> Ledger:
        """The ledger of an open or closed rollout; `RolloutNotFound` otherwise."""
        return self.registry.ledger(rollout_id)

    def rollouts(self) -> dict[RolloutId, str]:
        """Every rollout held, ``{rollout_id: "open" | "closed"}``."""
        return self.registry.states()

    def metrics(self) -> dict[str, float]:
        """Every counter of `GateMetrics`, ready for any logger."""
        return self.telemetry.as_dict()

    def health(self) -> GateHealth:
        """Whether the gate serves, what it holds, and any ledger-file problem."""
        held_open, held_closed = self.registry.counts()
        return GateHealth(
            serving=self.running,
            rollouts_open=held_open,
            rollouts_closed=held_closed,
            ledger_problem=self.ledger_file.problem if self.ledger_file is not None else None,
        )

    def held_ledgers(self) -> list[Ledger]:
        """Every ledger held, open and closed (what a ledger-file compaction keeps)."""
        return self.registry.held_ledgers()

    # ---- the capture path ------------------------------------------------------------

    def begin(
        self,
        rollout_id: str,
        *,
        kind: str,
        idempotency_key: str | None = None,
        body_fingerprint: str = "",
        request_id: str | None = None,
    ) -> GateCall | None:
        """A new captured request joins its rollout; None when it is to be served uncaptured.

        A rollout that already failed (poisoned) serves its later calls uncaptured.
        """
        record = self.registry.join(rollout_id, require_open=self.config.require_open)
        if record.uncaptured_reason is not None:
            self.telemetry.uncaptured_after_failure.inc()
            return None
        call = GateCall(
            rollout=record,
            kind=kind,
            idempotency_key=idempotency_key,
            body_fingerprint=body_fingerprint,
            request_id=request_id,
        )
        record.live.add(call)
        return call

    async def claim(self, call: GateCall) -> GateCall | None:
        """Hold ``call``'s idempotency key and request id, or return the earlier call to replay.

        One key is one call: a retry waits for the call holding its key and replays its
        answer once that call settled with a response; if it never completed, the first
        waiter takes the key over. A retry whose body differs is refused
        (``idempotency_key_reused``); a request id another call of the rollout used is
        refused (``duplicate_request_id``: ids name responses, which must be unique).
        """
        record: RolloutRecord = call.rollout
        key = call.idempotency_key
        while key is not None:
            holder = record.keys.get(key)
            if holder is None or holder is call or holder.phase in (ABANDONED, DROPPED):
                break
            if holder.body_fingerprint != call.body_fingerprint:
                raise RolloutConflict(
                    "idempotency_key_reused",
                    "this Idempotency-Key was used with a different request body",
                )
            if holder.replay is not None and holder.phase in (COMMITTED, FAILED):
                return holder
            if holder.final:
                break
            with anyio.move_on_after(self.config.parent_commit_timeout_s):
                await holder.settled.wait()
            if not holder.final:
                raise RolloutConflict(
                    "retry_in_flight", "the call holding this Idempotency-Key is still running"
                )
            if not record.accepting:
                raise RolloutConflict("rollout_closed", f"{record.rollout_id} is closed")
        if key is not None:
            record.keys[key] = call
        if call.request_id is not None:
            other = record.request_ids.get(call.request_id)
            if other is not None and other is not call:
                raise RolloutConflict(
                    "duplicate_request_id",
                    f"request id {call.request_id!r} was already used in this rollout",
                )
            record.request_ids[call.request_id] = call
        return None

    async def admit(self, call: GateCall, plan: Planner) -> None:
        """Plan (in a worker thread) and admit a call: ``Admitted`` is appended.

        The plan is made under the rollout's lock; if its parent has not committed yet the
        lock is released, the parent awaited (bounded), and the plan made again.
        """
        record: RolloutRecord = call.rollout
        while True:
            async with record.lock:
                _check_accepting(record)
                made = await anyio.to_thread.run_sync(
                    plan, list(record.priors), dict(record.gen_starts)
                )
                _check_accepting(record)
                self._check_weights()
                parent = record.calls.get(CallId(made.parent_id)) if made.parent_id else None
                if parent is None or parent.phase is COMMITTED:
                    self._admitted(call, made, parent)
                    return
            with anyio.move_on_after(self.config.parent_commit_timeout_s):
                await parent.settled.wait()
            if parent.phase is not COMMITTED:
                raise RolloutConflict(
                    "parent_not_committed", f"parent {parent.call_id} did not commit"
                )

    def _check_weights(self) -> None:
        state = self._weights
        if state is not None and state.phase is WeightPhase.FAILED:
            raise WeightsUnavailable(
                "weights_unavailable",
                f"a weight push to version {state.target} failed ({state.error}); the engine "
                "may hold half-updated weights: captured calls are refused until a full push "
                "succeeds",
            )

    def _admitted(self, call: GateCall, plan: ChatPlan, parent: GateCall | None) -> None:
        record: RolloutRecord = call.rollout
        call_id = CallId(record.ledger.next_call_id())
        try:
            self._append(
                record,
                Admitted(
                    call_id=call_id,
                    parent_id=plan.parent_id,
                    prefix_len=plan.prefix_len,
                    admitted_at=time.time_ns(),
                    request_fingerprint=plan.request_fingerprint,
                    formation=plan.formation,
                    break_cause=plan.break_cause,
                    splice_cause=plan.splice_cause,
                ),
            )
        except LedgerProtocolError as e:
            raise RolloutConflict(e.code, e.message) from e
        call.call_id, call.plan, call.parent = call_id, plan, parent
        call.step("admit")
        record.calls[call_id] = call

    def drop(self, call: GateCall) -> None:
        """A request refused before admission: it leaves nothing behind."""
        record: RolloutRecord = call.rollout
        if call.phase is PLANNING:
            call.step("drop")
        _release_claims(record, call)
        record.live.discard(call)
        self.registry.forget_if_idle(record)

    def engine_finished(self, call: GateCall, result: EngineResult) -> None:
        """The engine produced the final output: build the staged call and start the sink write."""
        try:
            if call.step("finish") is ABANDONED:
                return  # the harness left (or the rollout closed) while it generated
            call.result = result
            call.staged = self._staged_call(call, result)
        except TokcapError as e:
            call.stage_error = e.code
        except Exception as e:  # containment: never let one call's bug reach the engine
            call.stage_error = type(e).__name__
            _log.exception("tokcap gate: building the staged call of %s failed", call.call_id)
        if call.staged is None or self._tg is None:
            call.stage_error = call.stage_error or "gate_not_serving"
            call.sink_done.set()
            return
        self._tg.start_soon(self._guarded, self._stage, call)

    def _staged_call(self, call: GateCall, result: EngineResult) -> StagedCall:
        if result.finish_reason not in ("stop", "length") or not result.output_ids:
            raise TokcapError("engine_incomplete", f"finish_reason={result.finish_reason!r}")
        if any(map(math.isnan, result.logprobs)):
            raise TokcapError("bad_logprobs", "NaN logprob")
        if result.routes is None and self.config.capture.capture_routes:
            raise TokcapError(
                "routes_missing",
                "CaptureConfig.capture_routes is set but the engine returned no routed experts "
                "(start vLLM with routed-experts capture enabled)",
            )
        assert call.plan is not None
        assert call.call_id is not None
        parent = call.parent
        return StagedCall.from_engine_output(
            rollout_id=call.rollout_id,
            call_id=call.call_id,
            parent_id=call.plan.parent_id,
            parent_cum_len=call.plan.prefix_len,
            parent_chain_hash=parent.staged.chain_hash
            if parent is not None and parent.staged is not None
            else None,
            prompt_ids=result.prompt_ids,
            output_ids=result.output_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason or "",
            weight_version=result.weight_version,
            weight_version_last=result.weight_version_last,
            routes=result.routes,
        )

    async def _stage(self, call: GateCall) -> None:
        assert call.staged is not None
        started = time.perf_counter()
        try:
            with anyio.fail_after(self.config.capture.stage_timeout_s):
                await self.sink.put([call.staged])
        except TimeoutError:
            call.stage_error = "timeout"
        except Exception as e:  # the sink's failure is recorded for this rollout alone
            call.stage_error = getattr(e, "code", None) or type(e).__name__
        finally:
            call.sink_done.set()
            for hook in self._observers:
                hook.on_sink_write(call.staged, time.perf_counter() - started, call.stage_error)

    def response_complete(
        self,
        call: GateCall,
        *,
        response_id: str | None,
        output_fp: str | None,
        cum_text: str | None,
        conversation_fp: str | None,
    ) -> None:
        """The harness got the whole response: index the call as a parent, commit it later."""
        if call.step("respond") is ABANDONED:
            return
        call.response_id = response_id
        call.output_fp = output_fp
        record: RolloutRecord = call.rollout
        result = call.result
        if call.staged is not None and cum_text is not None and result is not None:
            assert call.call_id is not None
            assert call.plan is not None
            cum_ids = array("I", result.prompt_ids)
            cum_ids.extend(result.output_ids)
            call.prior = PriorCall(
                call.call_id,
                call.kind,
                cum_text,
                cum_ids,
                conversation_fp,
                gen_len=len(result.output_ids),
            )
            record.priors.append(call.prior)
            record.gen_starts[call.call_id] = len(call.plan.prompt_text)
        if self._tg is None:
            call.stage_error = call.stage_error or "gate_not_serving"
            self._settle(call)
            return
        self._tg.start_soon(self._guarded, self._commit, call)

    async def _commit(self, call: GateCall) -> None:
        await call.sink_done.wait()
        self._settle(call)

    def _settle(self, call: GateCall) -> None:
        """Commit a responded call, or fail it (served) with the reason it could not commit."""
        record: RolloutRecord = call.rollout
        record.live.discard(call)
        staged = call.staged
        if call.stage_error is None and staged is not None:
            try:
                self._append(
                    record,
                    Staged(
                        call_id=staged.call_id,
                        carry_len=staged.carry_len,
                        gen_len=staged.gen_len,
                        weight_version=staged.weight_version,
                        weight_version_last=staged.weight_version_last,
                        finish_reason=staged.finish_reason,
                        call_digest=staged.digest,
                        chain_hash=staged.chain_hash,
                        response_id=call.response_id,
                        output_fingerprint=call.output_fp,
                    ),
                )
            except LedgerProtocolError as e:
                reason = make_reason(LEDGER_REFUSED, e.code)
                _log.warning(
                    "tokcap gate: the ledger refused call %s of %s (%s); the rollout is poisoned",
                    call.call_id,
                    record.rollout_id,
                    e.code,
                )
                self.telemetry.contained.labels(e.code).inc()
                self._fail_served(call, reason)
                return
            call.step("commit")
            return
        self._fail_served(call, make_reason(STAGE_FAILED, call.stage_error))

    def _fail_served(self, call: GateCall, reason: str) -> None:
        record: RolloutRecord = call.rollout
        call.step("fail")
        if call.prior is not None and call.prior in record.priors:
            record.priors.remove(call.prior)
        record.uncaptured_reason = reason
        assert call.call_id is not None
        if record.ledger.status is OPEN:
            self._append(record, Failed(call_id=call.call_id, reason=reason, served=True))

    async def abandon(self, call: GateCall, detail: str) -> None:
        """The response never completed: ``Failed(served=False)``, and clear any staged row."""
        record: RolloutRecord = call.rollout
        if call.phase is PLANNING:
            self.drop(call)
            return
        if not call.in_flight:
            return
        was_finished = call.phase is FINISHED
        call.step("abandon")
        record.live.discard(call)
        _release_claims(record, call)
        assert call.call_id is not None
        if record.ledger.status is OPEN:
            reason = make_reason(UNCOMMITTED_CALL, detail)
            self._append(record, Failed(call_id=call.call_id, reason=reason, served=False))
        if was_finished:
            with anyio.CancelScope(shield=True):
                await self._clear_orphan(call)

    async def _clear_orphan(self, call: GateCall) -> None:
        """Free the staged row of a call no ledger commits (best effort, counted)."""
        await call.sink_done.wait()
        if call.stage_error is not None or call.staged is None:
            return
        try:
            with anyio.fail_after(self.config.capture.stage_timeout_s):
                await self.sink.clear([call.staged.key])
        except Exception:  # the key is named by no receipt; a sweep of the sink finds it
            self.telemetry.orphan_clears.labels("failed").inc()
            return
        self.telemetry.orphan_clears.labels("ok").inc()

    async def _guarded(self, step: Callable[[GateCall], Awaitable[None]], call: GateCall) -> None:
        """Run a background step of one call; any failure stays with that call's rollout."""
        try:
            await step(call)
        except Exception as e:
            self._contain(call, e)

    def _contain(self, call: GateCall, error: Exception) -> None:
        record: RolloutRecord = call.rollout
        code = error.code if isinstance(error, TokcapError) else type(error).__name__
        reason = make_reason(GATE_FAILED, code)
        _log.error(
            "tokcap gate: call %s of %s failed inside the gate (%s); the rollout is poisoned",
            call.call_id,
            record.rollout_id,
            code,
            exc_info=error,
        )
        self.telemetry.contained.labels(code).inc()
        record.uncaptured_reason = record.uncaptured_reason or reason
        record.poison_reason = record.poison_reason or reason
        record.live.discard(call)
        call.sink_done.set()
        call.settled.set()

    # ---- ledger entries and their observers -------------------------------------------

    def _append(self, record: RolloutRecord, event: Event) -> Entry:
        """Append to a rollout's ledger and tell the observers.

        `LedgerProtocolError` (the ledger refused the event) propagates and changes nothing.
        An observer's failure (the ledger file could not write) poisons the rollout.
        """
        entry = record.ledger.append(event)
        for hook in self._observers:
            try:
                hook.on_entry(record.rollout_id, entry)
            except Exception as e:  # a LedgerFileError above all; never the caller's problem
                self._persistence_failed(record, e)
        return entry

    def _persistence_failed(self, record: RolloutRecord, error: Exception) -> None:
        detail = error.detail if isinstance(error, LedgerFileError) else type(error).__name__
        reason = make_reason(LEDGER_WRITE_FAILED, detail)
        if record.poison_reason is None:
            _log.warning(
                "tokcap gate: %s could not be persisted (%s); the rollout is poisoned",
                record.rollout_id,
                error,
            )
            self.telemetry.ledger_write_failures.inc()
        record.poison_reason = record.poison_reason or reason
        record.uncaptured_reason = record.uncaptured_reason or reason

    # ---- control operations ------------------------------------------------------------

    def open(self, rollout_id: str) -> None:
        """Open a rollout before its first call (what ``GateConfig.require_open`` asks for);
        opening an open rollout again changes nothing."""
        self.registry.open(rollout_id)

    def declare_terminal(
        self, rollout_id: str, *, call_id: str | None = None, response_id: str | None = None
    ) -> Entry:
        """Name the rollout's terminal call (by call id or by response id)."""
        if (call_id is None) == (response_id is None):
            raise ValueError("give exactly one of call_id, response_id")
        record = self.registry.open_record(rollout_id)
        if call_id is not None:
            return self._append(record, TerminalDeclared(by="call_id", value=call_id))
        return self._append(record, TerminalDeclared(by="response_id", value=response_id or ""))

    async def close(
        self, rollout_id: str, reward: float | None, witnesses: Witnesses | None = None
    ) -> tuple[int, str]:
        """Close a rollout and return its ledger head, once durable.

        Calls still generating or still sending their response are abandoned
        (``uncommitted_call:closed_in_flight``, off-chain); responded calls are awaited
        until committed or failed. A rollout the gate poisoned gets ``Poisoned`` instead
        of ``Closed``. Raises `LedgerProtocolError` for a bad reward, `LedgerFileError` if
        the head could not be made durable (the rollout is closed all the same).
        """
        record = self.registry.open_record(rollout_id)
        record.closing = True
        try:
            for call in list(record.live):
                if call.in_flight:
                    await self.abandon(call, "closed_in_flight")
            for call in list(record.live):
                if call.phase is RESPONDED:
                    await call.settled.wait()
            if record.poison_reason is not None:
                self._append(record, Poisoned(reason=record.poison_reason))
            else:
                self._append(record, Closed(reward=reward, witnesses=witnesses or Witnesses()))
        finally:
            if record.ledger.status is OPEN:
                record.closing = False
        self.registry.mark_closed(record)
        for hook in self._observers:
            await hook.on_close(record.rollout_id)
        return record.ledger.head

    def release(self, rollout_id: str) -> None:
        """Forget a closed rollout (its manifest is no longer served)."""
        self.registry.release(rollout_id)
        for hook in self._observers:
            try:
                hook.on_release(rollout_id)
            except Exception as e:  # the release holds in memory; the file keeps stale entries
                _log.warning("tokcap gate: the release of %s was not persisted: %s", rollout_id, e)

    async def drain(self, rollout_id: str | None = None) -> None:
        """Wait until every call that finished on the engine is committed or failed."""
        if rollout_id is not None:
            records = [self.registry.open_record(rollout_id)]
        else:
            records = self.registry.records()
        for record in records:
            for call in list(record.live):
                if call.phase is FINISHED or call.phase is RESPONDED:
                    await call.settled.wait()

    def restore(self, ledgers: Iterable[Ledger]) -> list[RolloutId]:
        """Take back stored ledgers after a restart; return the ids poisoned on the way.

        A closed ledger is served as it was. One that was still open is poisoned with
        ``Poisoned(gate_restarted)`` (appended, so the ledger file keeps it) and held as
        closed: its in-flight calls are gone, so it is never resumed.
        """
        poisoned = []
        for record in self.registry.adopt(ledgers):
            self._append(record, Poisoned(reason=make_reason(GATE_RESTARTED)))
            self.registry.mark_closed(record)
            poisoned.append(record.rollout_id)
        return poisoned


def _check_accepting(record: RolloutRecord) -> None:
    if not record.accepting:
        raise RolloutConflict("rollout_closed", f"{record.rollout_id} is closed")


def _release_claims(record: RolloutRecord, call: GateCall) -> None:
    if call.idempotency_key is not None and record.keys.get(call.idempotency_key) is call:
        del record.keys[call.idempotency_key]
    if call.request_id is not None and record.request_ids.get(call.request_id) is call:
        del record.request_ids[call.request_id]
