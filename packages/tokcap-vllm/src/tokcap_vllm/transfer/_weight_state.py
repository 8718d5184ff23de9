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

Versions have one rule, here, for every door that takes one (`WeightSync.push`,
`GateWeightClient.push`, the labels of vLLM's ``/finish_weight_update`` and
``/update_weight_version`` a served gate watches): a version is an ``int`` in
``[0, 2**63)`` (the ledger stores it as a count below ``2**63``), and its label is its
canonical decimal spelling (ASCII digits, no sign, space or leading zero). Anything else
is `WeightPushError` ``bad_version``; a version at or below the one served is
``version_not_increasing`` (`check_version`, `version_of_label`, `next_version`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from ..errors import WeightPushError, WeightSyncError

__all__ = [
    "WeightPhase",
    "WeightPushError",
    "WeightState",
    "WeightSyncError",
    "begin",
    "check_version",
    "fail",
    "next_version",
    "succeed",
    "version_of_label",
]


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


def check_version(version: object) -> int:
    """``version`` if it is a weight version (an ``int``, not a bool, in ``[0, 2**63)``);
    else `WeightPushError` ``bad_version``."""
    if type(version) is not int or not 0 <= version < MAX_WEIGHT_VERSION:
        raise WeightPushError(
            "bad_version", f"a weight version is an int in [0, 2**63): {version!r}"[:300]
        )
    return version


def version_of_label(label: object) -> int:
    """The version a label spells (``"7"`` is 7); `WeightPushError` ``bad_version`` for any
    other spelling (``" 7"``, ``"07"``, ``"-5"``, ``"1e3"``, ``"0x10"``, ``"²"``, ...) or a
    version out of range. vLLM keeps labels as strings: only the canonical one round-trips."""
    if (
        not isinstance(label, str)
        or not 0 < len(label) <= 19
        or not label.isascii()
        or not label.isdigit()
        or (label[0] == "0" and label != "0")
    ):
        raise WeightPushError(
            "bad_version", f"a weight version label is a decimal int in [0, 2**63): {label!r}"[:300]
        )
    return check_version(int(label))


def next_version(current: int, version: object) -> int:
    """``version`` if it is a weight version above ``current``; else `WeightPushError`
    ``bad_version`` or ``version_not_increasing``."""
    target = check_version(version)
    if target <= current:
        raise WeightPushError("version_not_increasing", f"version {target} is not above {current}")
    return target


def begin(state: WeightState, target: int) -> WeightState:
    """Start loading ``target`` (must be a version above ``state.version``)."""
    check_version(target)
    phase = _step(state, "begin")
    next_version(state.version, target)
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
