"""What weights a served gate's engine holds, as learnt from the weight routes it guards.

In a served gate the trainer is another process: it drives vLLM's RL routes
(``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/update_weight_version``), which the gate authenticates and watches (`_guarded_routes`).
The answers move this tracker; the gate reads its `WeightState` before admitting a call
(`Gate.watch_weights`), so captured calls are refused (503 ``weights_unavailable``) while
the state is FAILED.

    READY(v) --start ok--> PUSHING --finish ok, label w--> READY(w)
    PUSHING --finish ok, label unchanged--> PUSHING (loaded) --update_weight_version w--> READY(w)
    any --start/update/finish failed--> FAILED(code)     FAILED --start ok--> PUSHING
    hold(reason): FAILED("held") whatever the phase, until release() (only from READY)

Rules beside the table:
- A finish that follows no successful update (the empty finish a client sends to clear a
  worker's flag after a failed finish) changes nothing: it loaded nothing.
- ``version`` moves only with a label that is an integer string (tokcap's versions); any
  other label leaves it, and READY then means "whole, version unknown to tokcap".
- A push whose KV reset (``/reset_prefix_cache?reset_running_requests=true``) never came
  before the next push let calls in flight keep their KV (push mode ``keep``): READY says
  ``kv_kept`` from the label until such a reset (`recomputed`).
- A hold is the fleet's: its own gate's successful push does not lift it (the other gates
  may not have the version yet); only `release` does, and only once the gate is READY.
- A label a route would set is asked first (`check_label`, before vLLM sees it): it must be
  a version's canonical spelling above the one served (`tokcap_vllm.transfer._weight_state`'s rule),
  else the route is refused and nothing changes, so the gate and the ledger never disagree.
- An engine put to sleep (``/sleep``) serves nothing the gate can vouch for: FAILED("asleep")
  until ``/wake_up`` says it is awake; a sleep of level 2 discards the weights, so only a
  full push leaves FAILED after it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Final

from ..errors import RolloutConflict, WeightPushError
from ..transfer import WeightPhase, WeightState, next_version, version_of_label

__all__ = ["ServedWeights"]

_log = logging.getLogger("tokcap_vllm.weights")
READY: Final = WeightPhase.READY
PUSHING: Final = WeightPhase.PUSHING
FAILED: Final = WeightPhase.FAILED


class ServedWeights:
    """The tracker; `state` has the shape `WeightSync.state` has, so a gate can watch either."""

    def __init__(self, version: int = 0) -> None:
        self._phase = READY
        self._version = version
        self._error: str | None = None
        self._label: str | None = None
        self._updates = 0
        self._loaded = False
        self.held: str | None = None
        self.asleep: int | None = None
        """The level of the sleep the engine is in (None: awake)."""
        self._kv_kept = False
        self._subscribers: list[Callable[[WeightState], None]] = []

    @property
    def state(self) -> WeightState:
        """The gate-facing state: FAILED while held, whatever the engine's phase."""
        if self.asleep is not None:
            return WeightState(phase=FAILED, version=self._version, error="asleep")
        if self.held is not None:
            return WeightState(phase=FAILED, version=self._version, error=f"held: {self.held}")
        kept = self._kv_kept and self._phase is READY
        return WeightState(
            phase=self._phase, version=self._version, error=self._error, kv_kept=kept
        )

    @property
    def engine_phase(self) -> str:
        """The engine's own phase, holds aside (READY, PUSHING or FAILED)."""
        return self._phase.name

    def subscribe(self, callback: Callable[[WeightState], None]) -> Callable[[], None]:
        """Call ``callback(state)`` after every change; returns an unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def _changed(self) -> None:
        state = self.state
        for callback in list(self._subscribers):
            try:
                callback(state)
            except Exception:
                _log.exception("a weight-state subscriber raised on %s", state)

    # ---- what the guarded routes ask, and what they answered ---------------------------

    def check_label(self, label: object) -> int:
        """The version ``label`` spells, if a route may label the engine with it now: a
        version's canonical spelling above the one served; else `WeightPushError`
        ``bad_version`` or ``version_not_increasing`` (nothing changes)."""
        return next_version(self._version, version_of_label(label))

    def started(self, label: str) -> None:
        """``/start_weight_update`` succeeded; ``label`` is the engine's version label now."""
        self._phase, self._error = PUSHING, None
        self._label, self._updates, self._loaded = label, 0, False
        self._changed()

    def updated(self) -> None:
        """``/update_weights`` succeeded."""
        self._updates += 1

    def finished(self, label: str) -> None:
        """``/finish_weight_update`` succeeded; ``label`` is the engine's label after it."""
        if self._phase is not PUSHING or self._updates == 0:
            return
        self._loaded = True
        if label != self._label:
            self._ready(label)

    def labelled(self, label: str) -> None:
        """``/update_weight_version`` succeeded."""
        if self._phase is READY or (self._phase is PUSHING and self._loaded):
            self._ready(label)

    def recomputed(self) -> None:
        """``/reset_prefix_cache?reset_running_requests=true`` succeeded: requests in flight
        recompute their KV with the weights loaded now (push mode ``recompute``)."""
        if self._kv_kept:
            self._kv_kept = False
            self._changed()

    def slept(self, level: int) -> None:
        """``/sleep`` succeeded at ``level`` (2: the weights were discarded)."""
        self.asleep = level
        if level >= 2:
            self._phase, self._error, self._loaded = FAILED, "slept_discarding_weights", False
        self._changed()

    def woke(self) -> None:
        """``/wake_up`` left the engine fully awake."""
        if self.asleep is not None:
            self.asleep = None
            self._changed()

    def failed(self, code: str) -> None:
        """A weight route failed: the engine may hold half-updated weights."""
        self._phase, self._error, self._loaded = FAILED, code, False
        self._changed()

    def _ready(self, label: str) -> None:
        self._phase, self._error, self._loaded = READY, None, False
        with contextlib.suppress(WeightPushError):  # a label no route checked: version unknown
            self._version = version_of_label(label)
        self._kv_kept = True  # until the push's KV reset says otherwise (`recomputed`)
        self._changed()

    # ---- the fleet's hold ------------------------------------------------------------

    def hold(self, reason: str) -> None:
        """Refuse captured calls until `release` (a push failed somewhere in the fleet)."""
        self.held = reason or "held"
        self._changed()

    def release(self) -> None:
        """Lift the hold; `RolloutConflict` ``weights_not_ready`` unless the engine is READY."""
        if self._phase is not READY:
            raise RolloutConflict(
                "weights_not_ready",
                f"the engine's weights are {self._phase.name} ({self._error}): push in full first",
            )
        self.held = None
        self._changed()
