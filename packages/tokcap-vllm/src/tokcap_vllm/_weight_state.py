"""What weights the engine serves: a pure state machine the gate can watch.

    READY(v) --begin(w > v)--> PUSHING(v -> w) --succeed--> READY(w)
                               PUSHING(v -> w) --fail-->    FAILED(v, w, code)
    FAILED   --begin(w > v)--> PUSHING

Invariants:
- ``version`` is the last version loaded *in full*; it only grows, and only on ``succeed``.
- READY is the one phase in which the engine generates from a known, whole set of weights.
  PUSHING starts when generation is paused (weights may change from then on); a push that
  fails after that point leaves FAILED, with generation still paused, until a later push
  succeeds in full. Nothing but a full push leaves FAILED: a captured call must never be
  admitted against a half-updated model.
- Every transition either applies or raises `WeightPushError` and changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from tokcap_core import TokcapError

__all__ = [
    "WeightPhase",
    "WeightPushError",
    "WeightState",
    "WeightSyncError",
    "begin",
    "fail",
    "succeed",
]


class WeightPushError(TokcapError, ValueError):
    """A push refused before anything was loaded: the engine serves what it served before.

    Codes: ``missing_tensors`` (a partial push), ``unknown_tensors``, ``shape_mismatch``,
    ``dtype_mismatch``, ``not_a_tensor``, ``non_finite_weights``, ``bad_version``,
    ``version_not_increasing``, ``bad_mode``, ``push_in_progress``, ``not_pushing``.
    """


class WeightSyncError(TokcapError, RuntimeError):
    """The engine side of a push failed (``stage_failed``: nothing loaded, state unchanged;
    ``<step>_failed`` after the pause: the state is FAILED), or the engine cannot take
    pushes at all (``extension_missing``, ``spec_unavailable``)."""


class WeightPhase(enum.Enum):
    """A phase of the engine's weights; compare with ``is``."""

    READY = "READY"
    PUSHING = "PUSHING"
    FAILED = "FAILED"


MAX_WEIGHT_VERSION: Final = 2**63
"""Versions are below this: the ledger stores each call's weight version as a u64 count
below 2**63, so a larger one would be refused at every commit, after the push loaded."""

READY: Final = WeightPhase.READY
PUSHING: Final = WeightPhase.PUSHING
FAILED: Final = WeightPhase.FAILED

_TRANSITIONS: Final[dict[WeightPhase, dict[str, WeightPhase]]] = {
    READY: {"begin": PUSHING},
    PUSHING: {"succeed": READY, "fail": FAILED},
    FAILED: {"begin": PUSHING},
}
_REFUSALS: Final[dict[WeightPhase, dict[str, str]]] = {
    READY: {"succeed": "not_pushing", "fail": "not_pushing"},
    PUSHING: {"begin": "push_in_progress"},
    FAILED: {"succeed": "not_pushing", "fail": "not_pushing"},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightState:
    """A snapshot of the engine's weights (immutable: subscribers may keep it)."""

    phase: WeightPhase
    version: int
    """The last version loaded in full (what the engine serves when READY)."""
    target: int | None = None
    """The version being pushed (PUSHING) or that failed (FAILED)."""
    error: str | None = None
    """FAILED: the code of the step that failed."""
    kv_kept: bool = False
    """READY: the push that loaded ``version`` let calls in flight keep the KV the older
    weights computed (push mode ``keep``); False: their KV was recomputed (or none ran)."""

    @property
    def serving(self) -> bool:
        """Whether captured calls may be admitted: READY, the weights are whole and known."""
        return self.phase is READY


def _step(state: WeightState, op: str) -> WeightPhase:
    phase = _TRANSITIONS[state.phase].get(op)
    if phase is None:
        raise WeightPushError(_REFUSALS[state.phase][op], f"{op} in phase {state.phase.name}")
    return phase


def begin(state: WeightState, target: int) -> WeightState:
    """Start loading ``target`` (must be an int above ``state.version``)."""
    if type(target) is not int or not 0 <= target < MAX_WEIGHT_VERSION:
        raise WeightPushError(
            "bad_version", f"a weight version is an int in [0, 2**63): {target!r}"
        )
    phase = _step(state, "begin")
    if target <= state.version:
        raise WeightPushError(
            "version_not_increasing", f"version {target} is not above {state.version}"
        )
    return WeightState(phase=phase, version=state.version, target=target)


def succeed(state: WeightState, *, kv_kept: bool = False) -> WeightState:
    """The push loaded every tensor, set the version and resumed generation (``kv_kept``:
    calls in flight kept their KV)."""
    phase = _step(state, "succeed")
    assert state.target is not None
    return WeightState(phase=phase, version=state.target, kv_kept=kv_kept)


def fail(state: WeightState, error: str) -> WeightState:
    """A step after the pause failed: the weights may be half-updated."""
    phase = _step(state, "fail")
    return WeightState(phase=phase, version=state.version, target=state.target, error=error)
