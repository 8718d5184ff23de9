"""Gate configuration (attrs, frozen, validated)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from tokcap_core.ledger import MAX_MANIFEST_BYTES

__all__ = ["CONTROL_TOKEN_ENV", "LEDGER_PATH_ENV", "GateConfig"]

CONTROL_TOKEN_ENV = "TOKCAP_CONTROL_TOKEN"
"""The environment variable the gate reads its control-plane token from by default."""
LEDGER_PATH_ENV = "TOKCAP_LEDGER_PATH"
"""The environment variable `GateConfig.from_environ` reads the ledger file path from."""


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
    max_body_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=attrs.validators.ge(1))
    weight_version: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    reasoning_markers: tuple[str, ...] = ("<think>",)
    """Text whose disappearance from re-rendered history means 'reasoning_stripped'."""

    # ---- control plane and persistence (part 2) ---------------------------------------
    control_token: str | None = attrs.field(default=None, repr=False)
    """The control plane's bearer token (a secret: never in ``repr``, logs or metrics)."""
    control_token_env: str | None = CONTROL_TOKEN_ENV
    """Where to read the token from when ``control_token`` is None."""
    ledger_path: str | None = None
    """The append-only ledger file (None: ledgers live in memory only)."""
    compact_after_releases: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    """Rewrite the ledger file without released rollouts once this many were released."""
    max_manifest_bytes: int = attrs.field(
        default=MAX_MANIFEST_BYTES, validator=attrs.validators.ge(1)
    )
    """A manifest larger than this is refused (``manifest_too_large``), never truncated."""
    max_page_size: int = attrs.field(default=1000, validator=attrs.validators.ge(1))
    """The largest page ``GET /tokcap/v1/rollouts`` returns."""

    def resolve_token(self, environ: Mapping[str, str]) -> str | None:
        """The control token: ``control_token``, else ``environ[control_token_env]``, else None."""
        if self.control_token:
            return self.control_token
        if self.control_token_env is None:
            return None
        return environ.get(self.control_token_env) or None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GateConfig:
        """The defaults, with ``ledger_path`` from ``TOKCAP_LEDGER_PATH`` when set.

        This is how a gate that vLLM builds by import path (``--middleware``) is configured;
        the token itself is read from ``TOKCAP_CONTROL_TOKEN`` when the control plane starts.
        """
        return cls(ledger_path=environ.get(LEDGER_PATH_ENV) or None)
