"""The capture path of the gate's driver: one call from its request to its commit.

`CapturePath` waits, writes and tells; what each event of a call means is the rollout
book's (`tokcap_vllm.gate._rollouts.RolloutBook`, its call events in
`tokcap_vllm.gate._lifecycle`): the driver tells it each event once and does what it answers.
The ASGI door (`tokcap_vllm.GateMiddleware`) hands the driver what it saw, once per
event, and reads nothing of the call.

Per captured request: `enter` has the book receive the call and claim its idempotency key
and request id (or answer again the earlier call that holds the key), plans it against its
rollout's parent index and has the book admit it (``Admitted``), with the `Ticket` the
engine runs it on (`CaptureHost`); `engine_finished` starts the sink write at once
(`StageWriter` batches the writes of calls that finish together); `response_complete`
(just before the response's last byte) has the book say whether it may complete, makes
the call a parent and schedules its commit (``Staged`` once the sink acknowledged, or
``Failed(served=True)`` if it did not); a call whose response never completed is
abandoned (``Failed(served=False)``, its staged row cleared: `response_ended`).

Containment: nothing that goes wrong with one call reaches the task group the gate
serves. A sink failure, a ledger refusal (``ledger_refused``) or an unexpected error
(``gate_failed``: the call is CONTAINED) fails that call and poisons its rollout; a
ledger-file write failure (``ledger_write_failed``) poisons its rollout (``Poisoned`` at
close); each is logged with its code and counted. Every other rollout goes on capturing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup

from tokcap_core import Entry, TokcapError
from tokcap_core.reasons import GATE_FAILED, LEDGER_WRITE_FAILED, make_reason
from tokcap_core.sink import SinkHealth, TokenSink

from ..errors import CallNotServed, GateError, SinkUnavailable, WeightsUnavailable
from ..persist import GateHooks, LedgerFileError
from ..transfer import WeightPhase, WeightState
from ._answers import ResponsesAnswer
from ._config import GateConfig
from ._host import EngineResult, Ticket
from ._lifecycle import Abandoned
from ._metrics import GateMetrics
from ._planning import Learned, Observed, ParentIndex, PlannedRequest
from ._records import GateCall, ResponsesTurn, RolloutRecord
from ._rollouts import RolloutBook
from ._stage_writer import StageWriter
from ._staging import media_ticket, staged_call
from ._wire import ResponseObserver

__all__ = ["AnswerAgain", "CapturePath", "Serve"]

_log = logging.getLogger("tokcap_vllm.gate")


@dataclass(frozen=True, slots=True)
class Serve:
    """An admitted call: hand its request to vLLM's handler with ``ticket`` in context."""

    call: GateCall
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class AnswerAgain:
    """A retry under the key of a call that settled: send its recorded answer again."""

    start: dict[str, Any]
    chunks: list[bytes]


class CapturePath:
    """The gate's calls: each event told to the book, staged into the sink, committed."""

    def __init__(
        self,
        config: GateConfig,
        sink: TokenSink,
        book: RolloutBook,
        telemetry: GateMetrics,
        observers: list[GateHooks],
    ) -> None:
        self.config = config
        self.sink = sink
        self.book = book
        self.telemetry = telemetry
        self.observers = observers
        self.tg: TaskGroup | None = None
        """The task group of the gate's `serve` (None: not serving)."""
        self.weights: WeightState | None = None
        """The watched weight state (`Gate.watch_weights`)."""
        self.kv_kept: set[int] = set()
        """Versions whose push let calls in flight keep their older KV (push mode ``keep``)."""
        self.stager = StageWriter(sink, config.capture.stage_timeout_s, self._written)
        """Writes staged calls to the sink, batching those that finish together."""

    async def enter(
        self,
        rollout_id: str,
        *,
        kind: str,
        request: Callable[[], PlannedRequest],
        idempotency_key: str | None = None,
        body_fingerprint: str = "",
        request_id: str | None = None,
        thread: ResponsesTurn | None = None,
        structured_outputs: object = None,
    ) -> Serve | AnswerAgain:
        """Admit a captured request: the call to serve, or an earlier answer to send again.

        A rollout that already failed refuses it (``rollout_poisoned``). A settled call: a
        retry under its idempotency key (its answer is sent again). One key is one call: a
        retry waits for the holder (bounded) and takes the key over if it never completed;
        a different body is refused (``idempotency_key_reused``), a request id another call
        of the rollout used too (``duplicate_request_id``). ``request`` binds the body to
        the tokenizer (after the claim, so a retry is answered again without re-planning).
        A request refused on the way leaves nothing behind. ``thread``: a Responses call's
        items; ``structured_outputs``: what the engine call's sampling params take of it.
        """
        call = self.book.call_received(
            rollout_id,
            kind=kind,
            require_open=self.config.require_open,
            idempotency_key=idempotency_key,
            body_fingerprint=body_fingerprint,
            request_id=request_id,
            thread=thread,
        )
        record = call.rollout
        try:
            held = self.book.call_claimed(call)
            while held is not None and held.answer is None:  # a retry of a call running
                with anyio.move_on_after(self.config.parent_commit_timeout_s):
                    await held.call.settled.wait()
                held = self.book.call_claimed(call, waited=held.call)
            if held is not None and held.answer is not None:
                self.book.call_dropped(call)
                return AnswerAgain(*held.answer)
            bound = request()
            while True:  # planned under the rollout's lock; a parent not committed is awaited
                async with record.lock:
                    self.book.call_planning(call, bound)
                    plan = await anyio.to_thread.run_sync(record.parents.planner(bound))
                    admitted = self.book.call_planned(
                        call, plan, admitted_at=time.time_ns(), unserved=self.serving_refusal()
                    )
                    if isinstance(admitted, Entry):
                        persisted = self.tell(record, admitted)
                        break
                with anyio.move_on_after(self.config.parent_commit_timeout_s):
                    await admitted.settled.wait()
                self.book.parent_waited(admitted)
            if not persisted:  # it would be served into a rollout that cannot verify
                await self.abandon(call, "ledger_write_failed")
                raise CallNotServed(
                    "ledger_write_failed",
                    f"the gate's ledger file could not record this call ({record.poison})",
                )
        except Exception:
            self.book.call_refused(call)
            raise
        assert call.plan is not None
        ticket = Ticket(
            prompt_ids=call.plan.prompt_ids,
            media=media_ticket(call, bound) if bound.images else None,
            structured_outputs=structured_outputs,
            on_finish=functools.partial(self.engine_finished, call),
            salt_version=self.weights.version if self.weights is not None else None,
        )
        return Serve(call, ticket)

    def serving_refusal(self) -> GateError | None:
        """Why no captured call can be served now: a sink that cannot stage it
        (`tokcap_core.sink.SinkHealth`), weights FAILED (or an engine asleep); None: none."""
        problem = self.sink.problem if isinstance(self.sink, SinkHealth) else None
        if problem is not None:
            return SinkUnavailable(
                "sink_unavailable",
                f"the sink cannot take staged calls ({problem}): captured calls are refused "
                "until it can",
            )
        state = self.weights
        if state is not None and state.phase is WeightPhase.FAILED and state.error == "asleep":
            return WeightsUnavailable(
                "weights_unavailable",
                "the engine is asleep (/sleep): captured calls are refused until /wake_up",
            )
        if state is not None and state.phase is WeightPhase.FAILED:
            return WeightsUnavailable(
                "weights_unavailable",
                f"a weight push to version {state.target} failed ({state.error}); the engine "
                "may hold half-updated weights: captured calls are refused until a full push "
                "succeeds",
            )
        return None

    def engine_finished(self, call: GateCall, result: EngineResult) -> None:
        """The engine produced the final output: build the staged call and start the sink write."""
        try:
            if not self.book.call_finished(call, result):
                return  # the harness left (or the rollout closed) while it generated
            call.staged = staged_call(
                call, result, self.config.capture.capture_routes, kv_kept=self.kv_kept
            )
        except TokcapError as e:
            call.stage_error = e.code
        except Exception as e:  # containment: never let one call's bug reach the engine
            call.stage_error = type(e).__name__
            _log.exception("tokcap gate: building the staged call of %s failed", call.call_id)
        if call.staged is None or self.tg is None:
            call.stage_error = call.stage_error or "gate_not_serving"
            call.sink_done.set()
            return
        self.stager.write(call, self.tg)

    async def _written(self, calls: list[GateCall], seconds: float) -> None:
        """Tell the observers each call's sink write (a failing observer: that rollout's)."""

        async def tell(call: GateCall) -> None:
            assert call.staged is not None
            for hook in self.observers:
                hook.on_sink_write(call.staged, seconds, call.stage_error)

        for call in calls:
            await self._guarded(tell, call)

    async def response_complete(
        self, call: GateCall, observer: ResponseObserver
    ) -> GateError | None:
        """The response's last byte (or a stream's ``[DONE]``) is about to go out, as
        ``observer`` saw it: the error to end it with instead (the call is abandoned), or
        None. A 200 the book lets complete makes the call a parent and schedules its
        commit; vLLM's own error answer abandons the call and goes out as it is."""
        why = _why_unserved(call, observer)
        if observer.status != 200:
            await self._abandoned(call, self.book.call_abandoned(call, why), observer.status)
            return None
        answer = None
        if observer.chunks is not None and observer.start is not None:
            answer = (observer.start, observer.chunks)
        seen = Observed(observer.response_id, observer.content, observer.tool_calls(), answer)
        learned = self._learned(call, seen) if call.staged is not None else None
        refusal = self.book.call_completing(call)
        if refusal is not None:
            await self._abandoned(call, self.book.call_abandoned(call, why), observer.status)
            return refusal
        if call.thread is not None and isinstance(observer.api, ResponsesAnswer):
            call.thread.output_items = observer.api.output  # what a previous_response_id names
        self._responded(call, self.book.call_responded(call, seen, learned))
        return None

    async def response_ended(self, call: GateCall, observer: ResponseObserver) -> GateError | None:
        """vLLM's handler returned: the error to end a response it left unfinished with (the
        call was abandoned while it generated), or None; a call still in flight (the client
        left, or no final output came) is abandoned."""
        refusal, abandoned = self.book.call_ended(call, _why_unserved(call, observer))
        await self._abandoned(call, abandoned, observer.status)
        return refusal

    def respond(self, call: GateCall, seen: Observed) -> None:
        """The harness got the whole response (``seen``): index the call as a parent, commit
        it later. Indexing that fails is logged; the call still commits, as no parent."""
        self._responded(call, self.book.call_responded(call, seen, self._learned(call, seen)))

    def _responded(self, call: GateCall, commits: bool) -> None:
        if not commits:
            return
        if self.tg is None:
            call.stage_error = call.stage_error or "gate_not_serving"
            self._settle(call)
            return
        self.tg.start_soon(self._guarded, self._commit, call)

    def _learned(self, call: GateCall, seen: Observed) -> Learned | None:
        try:
            assert call.request is not None
            assert call.plan is not None
            assert call.result is not None
            assert call.call_id is not None
            return ParentIndex.learn(
                call.request,
                call_id=call.call_id,
                kind=call.kind,
                plan=call.plan,
                result=call.result,
                seen=seen,
            )
        except Exception:  # containment: the harness still gets its answer
            _log.exception("tokcap gate: indexing call %s failed", call.call_id)
            return None

    async def _abandoned(self, call: GateCall, abandoned: Abandoned | None, status: int) -> None:
        """Tell an abandonment, clear its staged row; forget the rollout if vLLM refused the
        call itself (its own 4xx) and none of its calls was served."""
        if abandoned is None:
            return
        await self._after_abandon(call, abandoned)
        if 400 <= status < 500:
            self._forget_if_unserved(call)

    def _forget_if_unserved(self, call: GateCall) -> None:
        """Forget the rollout if none of its calls was served, so requests vLLM refuses
        leave no rollout behind, like those the gate refuses (the observers hear a release:
        the ledger file records one)."""
        if not self.book.call_unserved(call):
            return
        for hook in self.observers:
            try:
                hook.on_release(call.rollout_id)
            except Exception as e:  # memory holds; the file keeps the stale entries
                _log.warning("tokcap gate: forgetting %s was not persisted: %s", call.rollout_id, e)

    async def _commit(self, call: GateCall) -> None:
        await call.sink_done.wait()
        self._settle(call)

    def _settle(self, call: GateCall) -> None:
        """Commit a responded call, or fail it (served) with the reason it could not commit."""
        entry, refused = self.book.call_committed(call)
        if refused is not None:
            _log.warning(
                "tokcap gate: the ledger refused call %s of %s (%s); the rollout is poisoned",
                call.call_id,
                call.rollout_id,
                refused,
            )
            self.telemetry.contained.labels(refused).inc()
        if entry is not None:
            self.tell(call.rollout, entry)

    async def abandon(self, call: GateCall, detail: str) -> bool:
        """The response never completed: ``Failed(served=False)``, and clear any staged row.
        False if there was nothing to abandon (the call was not in flight)."""
        abandoned = self.book.call_abandoned(call, detail)
        if abandoned is None:
            return False
        await self._after_abandon(call, abandoned)
        return True

    async def _after_abandon(self, call: GateCall, abandoned: Abandoned) -> None:
        if abandoned.entry is not None:
            self.tell(call.rollout, abandoned.entry)
        if abandoned.clear_row:
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
            code = e.code if isinstance(e, TokcapError) else type(e).__name__
            _log.error(
                "tokcap gate: call %s of %s failed inside the gate (%s); the rollout is poisoned",
                call.call_id,
                call.rollout_id,
                code,
                exc_info=e,
            )
            self.telemetry.contained.labels(code).inc()
            self.book.call_contained(call, make_reason(GATE_FAILED, code))

    def tell(self, record: RolloutRecord, entry: Entry) -> bool:
        """Tell the observers an entry of ``record``'s ledger; False if one could not (the
        ledger file could not write it): the rollout is then poisoned."""
        told = True
        for hook in self.observers:
            try:
                hook.on_entry(record.rollout_id, entry)
            except Exception as e:  # a LedgerFileError above all; never the caller's problem
                told = False
                detail = e.detail if isinstance(e, LedgerFileError) else type(e).__name__
                if self.book.unpersisted(record, make_reason(LEDGER_WRITE_FAILED, detail)):
                    _log.warning(
                        "tokcap gate: %s could not be persisted (%s); the rollout is poisoned",
                        record.rollout_id,
                        e,
                    )
                    self.telemetry.ledger_write_failures.inc()
        return told


def _why_unserved(call: GateCall, observer: ResponseObserver) -> str:
    """Why a call's response ended without being served (the detail of its ``Failed``)."""
    if observer.status not in (0, 200):
        return f"http_{observer.status}"
    if not observer.done:
        return "client_disconnected"
    if call.result is not None and call.result.finish_reason == "abort":
        return "engine_aborted"
    return call.stage_error or "no_final_output"
