"""Gate configuration (attrs, frozen, validated)."""

from __future__ import annotations

import attrs

__all__ = ["GateConfig"]


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class GateConfig:
    """How the gate routes, admits and stages captured calls.

    ``parent_commit_timeout_s`` bounds how long a child waits for its parent's sink
    acknowledgement; ``stage_timeout_s`` bounds one sink write; ``weight_version`` is
    recorded when the engine reports none (or a non-integer label).
    """

    path_prefix: str = "/tokcap/rollouts/"
    rollout_header: str = "x-tokcap-rollout-id"
    idempotency_header: str = "idempotency-key"
    parent_commit_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    stage_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    max_body_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_positive)
    weight_version: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    reasoning_markers: tuple[str, ...] = ("<think>",)
    """Text whose disappearance from re-rendered history means 'reasoning_stripped'."""
