"""Gate configuration (attrs, frozen, validated: a bad value raises `ConfigError` ``bad_<field>``).

What is captured and the secrets live in the core's `CaptureConfig` (``GateConfig.capture``),
the one configuration a trainer and a gate share; ``GateConfig`` adds how the gate routes,
bounds and persists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from tokcap_core import CaptureConfig, ConfigError
from tokcap_core.config import at_least, non_empty_text, one_of, positive_number
from tokcap_core.ledger import MAX_MANIFEST_BYTES

from ._options import Option, build, from_environ, options_of
from ._planning import ON_RENDER_MISMATCH, REASONING_MODES

__all__ = ["CONTROL_TOKEN_ENV", "LEDGER_PATH_ENV", "GateConfig", "gate_options"]

CONTROL_TOKEN_ENV = "TOKCAP_CONTROL_TOKEN"
"""The environment variable the gate reads its control-plane token from by default."""
LEDGER_PATH_ENV = "TOKCAP_LEDGER_PATH"
"""The environment variable `GateConfig.from_environ` reads the ledger file path from."""


def _capture(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, CaptureConfig):
        raise ConfigError("bad_capture", f"capture must be a CaptureConfig: {value!r}")


def _path_prefix(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and value.startswith("/") and value.endswith("/")):
        raise ConfigError("bad_path_prefix", f"path_prefix must start and end with '/': {value!r}")


def _markers(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, tuple) and all(isinstance(m, str) and m for m in value)):
        raise ConfigError(
            "bad_reasoning_markers", f"reasoning_markers must be a tuple of str: {value!r}"
        )


def _hosts(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (
        isinstance(value, tuple)
        and all(isinstance(h, str) and h and "/" not in h and h == h.strip() for h in value)
    ):
        raise ConfigError(
            "bad_allow_remote_media",
            f"allow_remote_media must be a tuple of hosts ('host' or 'host:port'): {value!r}",
        )


def _optional_text(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        non_empty_text(_, attribute, value)


@attrs.frozen(kw_only=True)
class GateConfig:
    """How the gate routes, admits, bounds and persists captured calls.

    ``capture`` holds the capture policy and secrets (token, staging timeout, routes,
    token ids to the harness). ``parent_commit_timeout_s`` bounds how long a child (or a
    retry) waits for the call it depends on; ``weight_version`` is recorded when the
    engine reports none (or a non-integer label).
    """

    capture: CaptureConfig = attrs.field(factory=CaptureConfig, validator=_capture)
    path_prefix: str = attrs.field(default="/tokcap/rollouts/", validator=_path_prefix)
    rollout_header: str = attrs.field(default="x-tokcap-rollout-id", validator=non_empty_text)
    idempotency_header: str = attrs.field(default="idempotency-key", validator=non_empty_text)
    parent_commit_timeout_s: float = attrs.field(default=60.0, validator=positive_number)
    max_body_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=at_least(1))
    max_chars_per_token: int = attrs.field(default=32, validator=at_least(1))
    """A prompt longer than ``max_model_len * max_chars_per_token`` characters is refused
    (``prompt_too_long``) before it is tokenised: natural text averages ~4 per token."""
    max_open_rollouts: int = attrs.field(default=100_000, validator=at_least(1))
    """More open rollouts than this are refused (``too_many_open_rollouts``, 503)."""
    weight_version: int = attrs.field(default=0, validator=at_least(0))
    reasoning_markers: tuple[str, ...] = attrs.field(default=("<think>",), validator=_markers)
    """Text that opens a reasoning block: history re-rendered without it is a
    ``reasoning_stripped`` break (or a ``reasoning`` splice, see ``reasoning``)."""
    on_render_mismatch: Literal["splice", "break"] = attrs.field(
        default="splice", validator=one_of(*ON_RENDER_MISMATCH)
    )
    """When the chat template renders a parent's turn differently from what the model
    generated (special tokens, invalid UTF-8, re-serialised tool calls, whitespace):
    ``"splice"`` keeps the parent's exact ids and tokenises only the new messages (the
    child stays on the chain, counted by splice cause); ``"break"`` starts a new root
    (``template_mismatch``)."""
    reasoning: Literal["follow_template", "keep_model_tokens"] = attrs.field(
        default="follow_template", validator=one_of(*REASONING_MODES)
    )
    """When the template strips the model's reasoning from earlier turns:
    ``"follow_template"`` trains on what the template serves (a new root,
    ``reasoning_stripped``); ``"keep_model_tokens"`` keeps the model's own reasoning tokens
    and splices the new messages after them (a ``reasoning`` splice)."""
    allow_remote_media: tuple[str, ...] = attrs.field(default=(), validator=_hosts)
    """Hosts (``host``, any port; or ``host:port``) whose ``http``/``https`` image URLs the
    gate fetches itself and binds as data URLs (`tokcap_vllm.gate._remote_media`); empty,
    the default: every remote image URL is refused (``remote_media_refused``)."""
    remote_media_timeout_s: float = attrs.field(default=10.0, validator=positive_number)
    """How long the gate waits on each phase of a remote image's fetch (connect, each read)."""
    ledger_path: str | None = attrs.field(default=None, validator=_optional_text)
    """The append-only ledger file (None: ledgers live in memory only)."""
    compact_after_releases: int = attrs.field(default=1024, validator=at_least(1))
    """Rewrite the ledger file without released rollouts once this many were released."""
    max_manifest_bytes: int = attrs.field(default=MAX_MANIFEST_BYTES, validator=at_least(1))
    """A manifest larger than this is refused (``manifest_too_large``), never truncated."""
    max_page_size: int = attrs.field(default=1000, validator=at_least(1))
    """The largest page ``GET /tokcap/v1/rollouts`` returns."""
    require_open: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Refuse calls (404 ``unknown_rollout``) for rollouts nobody opened on this gate with
    ``POST /tokcap/v1/rollouts/{id}/open``: a fleet's gates never split one rollout's
    custody, and unauthenticated clients cannot create rollouts."""
    owner_lease_s: float = attrs.field(default=600.0, validator=positive_number)
    """How long a rollout's owner (``X-Tokcap-Owner``, a fleet's token) may stay silent
    before another owner may take its rollouts over (a restarted trainer's reclaim); a
    trainer that keeps talking to the gate is never taken from."""
    control_token_file: str | None = attrs.field(default=None, validator=_optional_text)
    """A file holding the control token, read when neither ``capture.control_token`` nor
    its environment variable is set (a token is never an option: it would show in ``ps``)."""

    def resolve_token(self, environ: Mapping[str, str]) -> str | None:
        """The control token: ``capture.control_token``, else the variable
        ``capture.control_token_env`` names (default ``TOKCAP_CONTROL_TOKEN``), else the
        contents of ``control_token_file`` (stripped), else None.

        `ConfigError` ``bad_control_token_file`` if the file cannot be read or is empty.
        """
        if self.capture.control_token:
            return self.capture.control_token
        token = environ.get(self.capture.control_token_env or CONTROL_TOKEN_ENV)
        if token or self.control_token_file is None:
            return token or None
        try:
            with open(self.control_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                "bad_control_token_file", f"control_token_file cannot be read: {e}"
            ) from None
        if not token:
            raise ConfigError("bad_control_token_file", "control_token_file is empty")
        return token

    @classmethod
    def from_texts(cls, texts: Mapping[str, str]) -> GateConfig:
        """The config for ``{field: text}`` (fields of `gate_options`, parsed by type).

        Raises `ConfigError` ``bad_<field>`` naming the option at fault.
        """
        options = gate_options()
        capture = build(CaptureConfig, options, texts)
        config: GateConfig = build(cls, options, texts, capture=capture)
        return config

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GateConfig:
        """The config the ``TOKCAP_<FIELD>`` variables set (`gate_options`), defaults elsewhere.

        This is how a gate that vLLM builds by import path (``--middleware``, the plugin)
        is configured (``TOKCAP_LEDGER_PATH``, ``TOKCAP_REQUIRE_OPEN``, ...); the token
        itself is read from ``TOKCAP_CONTROL_TOKEN`` (or ``TOKCAP_CONTROL_TOKEN_FILE``'s
        file) when the control plane starts.
        """
        return cls.from_texts(from_environ(environ, gate_options()))


TRAINER_ONLY_FIELDS = frozenset({"segments", "min_valid_fraction", "max_seq_len"})
"""`CaptureConfig` fields only the trainer reads: not options of a gate."""
SECRET_FIELDS = frozenset({"control_token"})
"""Never an option (flags show in ``ps``): the token comes from a variable or a file."""


def gate_options() -> list[Option]:
    """Every option of a served gate: `GateConfig`'s fields, then `CaptureConfig`'s
    (but `TRAINER_ONLY_FIELDS` and `SECRET_FIELDS`)."""
    return [
        *options_of(GateConfig, exclude={"capture"}),
        *options_of(CaptureConfig, exclude=TRAINER_ONLY_FIELDS | SECRET_FIELDS),
    ]
