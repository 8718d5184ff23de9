"""The gate: holds its rollouts, serves the control operations, and runs the capture path.

The gate is a driver around one owner of its rollouts' events, the `RolloutBook`
(`tokcap_vllm.gate._rollouts`, ``Gate.book``): each control operation tells the book its event
and does what it answers (a close: abandon this call, wait for that one, then the entry);
one call's way from its request to its commit is `tokcap_vllm.gate._capture.CapturePath`
(``Gate.capture``), which keeps each failure inside its rollout. `Gate` keeps the task
group (`serve`), the sink, the observers and the weight state the capture path reads.

The control operations (`declare_terminal`, `close`, `release`) are what the control
plane (`ControlPlane`) serves over HTTP. With ``GateConfig.ledger_path`` the gate
replays its ledger file when built; rollouts that were open at a crash are poisoned
(``gate_restarted``), never resumed.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import anyio

from tokcap_core import Entry, Ledger, MemorySink
from tokcap_core.ids import RolloutId, validate_rollout_id
from tokcap_core.ledger import Event, Witnesses
from tokcap_core.sink import SinkHealth, TokenSink

from ..errors import ControlUnavailable, RolloutConflict
from ..persist import GateHooks, LedgerFile, make_durable
from ..transfer import WeightState
from ._capture import CapturePath
from ._config import GateConfig
from ._metrics import GateMetrics
from ._rollouts import Abandon, RolloutBook, RolloutRecord

if TYPE_CHECKING:
    from ..transfer import WeightSync

__all__ = ["Gate", "GateHealth"]

_log = logging.getLogger("tokcap_vllm.gate")


class GateHealth:
    """What ``GET /tokcap/v1/health`` reports: ``ok``, ``degraded`` or ``down``."""

    __slots__ = (
        "engine",
        "ledger_problem",
        "rollouts_closed",
        "rollouts_open",
        "serving",
        "sink_problem",
        "weights",
    )

    def __init__(
        self,
        *,
        serving: bool,
        rollouts_open: int,
        rollouts_closed: int,
        ledger_problem: str | None,
        sink_problem: str | None = None,
        weights: str = "READY",
        engine: str = "unknown",
    ) -> None:
        self.serving = serving
        self.rollouts_open = rollouts_open
        self.rollouts_closed = rollouts_closed
        self.ledger_problem = ledger_problem
        self.sink_problem = sink_problem
        self.weights = weights
        """READY, PUSHING, or FAILED with why (``FAILED: asleep``, ...)."""
        self.engine = engine
        """``running``, ``paused``, ``asleep``, ``unresponsive`` or ``unknown``."""

    @property
    def status(self) -> str:
        """``down`` when the gate is not serving; ``degraded`` when something stops or
        stalls captured calls (the ledger file, the sink, the weights, an engine that is
        paused, asleep or not answering); else ``ok``."""
        if not self.serving:
            return "down"
        problems = (
            self.ledger_problem is not None,
            self.sink_problem is not None,
            self.weights.startswith("FAILED"),
            self.engine not in ("running", "unknown"),
        )
        return "degraded" if any(problems) else "ok"


class Gate:
    """Holds every rollout this server captures, stages their calls and serves their ledgers."""

    def __init__(self, config: GateConfig | None = None, *, sink: TokenSink | None = None) -> None:
        self.config = config or GateConfig()
        self.sink: TokenSink = sink if sink is not None else MemorySink()
        self.book = RolloutBook(
            max_open=self.config.max_open_rollouts,
            flag=anyio.Event,
            lock=anyio.Lock,
            owner_lease_s=self.config.owner_lease_s,
        )
        self.instance = secrets.token_hex(8)
        """This gate's instance id: a restarted gate (a new process) has a new one, which is
        how a fleet tells a restart from a rollout it never opened."""
        self.telemetry = GateMetrics(self.book.counts)
        self._observers: list[GateHooks] = [self.telemetry]
        self.capture = CapturePath(
            self.config, self.sink, self.book, self.telemetry, self._observers
        )
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
            self.capture.tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self.capture.tg = None

    @property
    def running(self) -> bool:
        """Whether `serve` is running (captured calls need it)."""
        return self.capture.tg is not None

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

        The capture path also learns which versions' pushes let calls in flight keep their
        KV (``WeightState.kv_kept``): a captured call's KV spans (`tokcap_core.provenance`)
        follow from it.
        """
        capture = self.capture

        def follow(state: WeightState) -> None:
            capture.weights = state
            if not state.serving:
                return  # only READY says how the push that loaded ``version`` treated KV
            if state.kv_kept:
                capture.kv_kept.add(state.version)
            else:
                capture.kv_kept.discard(state.version)

        follow(sync.state)

        unsubscribe = sync.subscribe(follow)

        def unwatch() -> None:
            unsubscribe()
            capture.weights = None

        return unwatch

    # ---- reading ---------------------------------------------------------------------

    def ledger(self, rollout_id: str) -> Ledger:
        """The ledger of an open or closed rollout; `RolloutNotFound` otherwise."""
        return self.book.ledger(rollout_id)

    def rollouts(self) -> dict[RolloutId, str]:
        """Every rollout held, ``{rollout_id: "open" | "closed"}``."""
        return self.book.states()

    def metrics(self) -> dict[str, float]:
        """Every counter of `GateMetrics`, ready for any logger."""
        return self.telemetry.as_dict()

    def health(self, engine: str = "unknown") -> GateHealth:
        """Whether the gate serves, what it holds, and what would stop or stall a captured
        call: the ledger file, the sink, the weights; ``engine`` is the engine's own state,
        as the caller found it."""
        held_open, held_closed = self.book.counts()
        state = self.capture.weights
        weights = "READY" if state is None else state.phase.name
        if state is not None and state.error is not None:
            weights = f"{weights}: {state.error}"
        return GateHealth(
            serving=self.running,
            rollouts_open=held_open,
            rollouts_closed=held_closed,
            ledger_problem=self.ledger_file.problem if self.ledger_file is not None else None,
            sink_problem=self.sink.problem if isinstance(self.sink, SinkHealth) else None,
            weights=weights,
            engine=engine,
        )

    def held_ledgers(self) -> list[Ledger]:
        """Every ledger held, open and closed (what a ledger-file compaction keeps)."""
        return self.book.held_ledgers()

    def _append(self, record: RolloutRecord, event: Event) -> Entry:
        """Append an entry as it is, telling the observers (what tests feed a gate's ledger
        with, a stored rollout's entries, without an engine)."""
        entry = self.book.append(record, event)
        self.capture.tell(record, entry)
        return entry

    # ---- control operations ------------------------------------------------------------

    def open(self, rollout_id: str, *, owner: str | None = None) -> None:
        """Open a rollout before its first call (what ``GateConfig.require_open`` asks for),
        held by ``owner`` if given; opening an open rollout again changes nothing."""
        self.book.opened(rollout_id, owner=owner, now=time.monotonic())

    async def open_fresh(self, rollout_id: str, *, owner: str | None = None) -> None:
        """`open`, refusing an id the sink still holds staged rows of when this gate does not
        hold it (`RolloutConflict` ``stale_rows``): rows an earlier rollout of that id left
        (on a gate since restarted, or on another gate) would collide with this one's
        (``conflicting_put``) or be read as its own: clear them first
        (`GateFleet.orphaned_keys`). `ControlUnavailable` ``sink_unavailable`` if the sink
        cannot list its rows."""
        if rollout_id not in self.book.states():
            prefix = validate_rollout_id(rollout_id) + "/"
            try:
                keys = await self.sink.staged_keys()
            except Exception as e:  # a sink that cannot answer now: the open is refused
                raise ControlUnavailable(
                    "sink_unavailable", f"the sink cannot list its rows ({type(e).__name__})"
                ) from e
            left = [k for k in keys if k.startswith(prefix)]
            if left:
                raise RolloutConflict(
                    "stale_rows",
                    f"the sink still holds {len(left)} staged row(s) of an earlier {rollout_id} "
                    "(its gate restarted or another gate held it): clear them, or use a new id",
                )
        self.open(rollout_id, owner=owner)

    def touch_owner(self, owner: str | None) -> None:
        """``owner`` spoke to this gate now (its lease runs from here: `_rollouts.Owners`)."""
        self.book.owners.touch(owner, time.monotonic())

    def check_owner(self, rollout_id: str, owner: str | None) -> None:
        """`RolloutConflict` ``rollout_owned`` unless ``owner`` may act on ``rollout_id``."""
        self.book.check_owner(rollout_id, owner, time.monotonic())

    def declare_terminal(
        self,
        rollout_id: str,
        *,
        call_id: str | None = None,
        response_id: str | None = None,
        owner: str | None = None,
    ) -> Entry:
        """Name the rollout's terminal call (by call id or by response id).

        The call must be one the harness was answered with (`InvalidBody`
        ``unknown_terminal`` otherwise, and the rollout is left as it was): a declared
        terminal that names nothing would poison the rollout for good at its receipt.
        """
        record, entry = self.book.terminal_declared(
            rollout_id,
            call_id=call_id,
            response_id=response_id,
            owner=owner,
            now=time.monotonic(),
        )
        self.capture.tell(record, entry)
        return entry

    async def close(
        self,
        rollout_id: str,
        reward: float | None,
        witnesses: Witnesses | None = None,
        *,
        owner: str | None = None,
    ) -> tuple[int, str]:
        """Close a rollout and return its ledger head, once durable.

        Calls still generating or still sending their response are abandoned
        (``uncommitted_call:closed_in_flight``, off-chain); responded calls are awaited
        until committed or failed. A rollout the gate poisoned gets ``Poisoned`` instead
        of ``Closed``. Raises `LedgerProtocolError` for a bad reward, `LedgerFileError` if
        the head could not be made durable (the rollout is closed all the same);
        `RolloutConflict` ``rollout_owned`` if another live owner holds it.
        """
        head = await self._close_in_memory(rollout_id, reward, witnesses, owner)
        await make_durable(self._observers, [rollout_id])
        return head

    async def close_many(
        self,
        closes: Sequence[tuple[str, float | None, Witnesses | None]],
        *,
        owner: str | None = None,
    ) -> list[tuple[int, str] | Exception]:
        """Close several rollouts with one durable write shared by all (group commit).

        ``closes`` holds ``(rollout_id, reward, witnesses)``; each rollout closes as in
        `close`, all of them concurrently, then the observers make every closed head
        durable at once (the ledger file: one fsync). The answer holds, in order, each
        rollout's head or the exception its close raised (`RolloutNotFound`,
        `LedgerProtocolError`, ...); if the durable write failed, every rollout closed by
        this call gets that `LedgerFileError` (each is closed all the same, as in `close`).
        """
        out: list[tuple[int, str] | Exception] = [
            RuntimeError("not closed") for _ in closes
        ]  # every slot is replaced below

        async def one(index: int) -> None:
            try:
                out[index] = await self._close_in_memory(*closes[index], owner)
            except Exception as e:  # reported for this rollout alone, never lost
                out[index] = e

        async with anyio.create_task_group() as tg:
            for index in range(len(closes)):
                tg.start_soon(one, index)
        closed = [i for i, r in enumerate(out) if isinstance(r, tuple)]
        try:
            await make_durable(self._observers, [closes[i][0] for i in closed])
        except Exception as e:
            for i in closed:
                out[i] = e
        return out

    async def _close_in_memory(
        self,
        rollout_id: str,
        reward: float | None,
        witnesses: Witnesses | None,
        owner: str | None = None,
    ) -> tuple[int, str]:
        record = self.book.close_requested(rollout_id, owner=owner, now=time.monotonic())
        try:
            while (step := self.book.close_next(record)) is not None:
                if isinstance(step, Abandon):
                    await self.capture.abandon(step.call, "closed_in_flight")
                else:
                    await step.call.settled.wait()
            entry = self.book.closed(record, reward=reward, witnesses=witnesses)
        except BaseException:
            self.book.close_failed(record)
            raise
        self.capture.tell(record, entry)
        return record.ledger.head

    def release(self, rollout_id: str, *, owner: str | None = None) -> None:
        """Forget a closed rollout (its manifest is no longer served); `RolloutConflict`
        ``rollout_owned`` if another live owner holds it. The media blobs it alone named
        are freed by the next `free_media`."""
        self.book.released(rollout_id, owner=owner, now=time.monotonic())
        self.capture.stager.media.released(rollout_id)
        for hook in self._observers:
            try:
                hook.on_release(rollout_id)
            except Exception as e:  # the release holds in memory; the file keeps stale entries
                _log.warning("tokcap gate: the release of %s was not persisted: %s", rollout_id, e)

    async def free_media(self) -> None:
        """Clear from the sink the media blobs no rollout the gate holds names any more
        (the control plane's release does, after `release`). A sink that fails the clear
        is logged; the blobs are cleared by the next call."""
        try:
            await self.capture.stager.media.free()
        except Exception as e:  # the release holds; the blobs wait for the next free
            _log.warning("tokcap gate: freeing media blobs failed: %s", e)

    async def drain(self, rollout_id: str | None = None) -> None:
        """Wait until every call that finished on the engine is committed or failed."""
        for call in self.book.unsettled(rollout_id):
            await call.settled.wait()

    def restore(self, ledgers: Iterable[Ledger]) -> list[RolloutId]:
        """Take back stored ledgers after a restart; return the ids poisoned on the way.

        A closed ledger is served as it was. One that was still open is poisoned with
        ``Poisoned(gate_restarted)`` (appended, so the ledger file keeps it) and held as
        closed: its in-flight calls are gone, so it is never resumed.
        """
        poisoned = []
        for record, entry in self.book.restored(ledgers):
            self.capture.tell(record, entry)
            poisoned.append(record.rollout_id)
        return poisoned
