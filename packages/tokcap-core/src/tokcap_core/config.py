"""Capture configuration: the one place users say what is captured and how strictly.

`CaptureConfig` is written once and read by both sides: the gate (``GateConfig.capture``:
the control token, the staging timeout, whether routes are staged and whether token ids
may reach the harness) and the trainer (segments, ``min_valid_fraction``,
``max_seq_len``). An unsupported combination cannot be built: the constructor raises
`ConfigError` with a code, and `CaptureConfig.validate` re-checks and returns warnings for
risky-but-legal choices. The control token can be minted by `with_derived`, whose
environment and randomness come in as arguments. The token is never printed.

Every adapter rejects bad configuration the same way: a `ConfigError` whose code is
``bad_<field>``; the attrs-compatible validators here (`at_least`, `positive_number`,
`non_empty_text`, `one_of`) are what their config classes use.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._errors import ConfigError
from ._policy import check_min_valid_fraction
from ._receipt import SEGMENT_MODES
from .routes import dtype_for_experts

__all__ = ["CaptureConfig", "at_least", "non_empty_text", "one_of", "positive_number"]

_MAX_INT32_EXPERTS = 2**31
_REDACTED = "<redacted>"


def _new_token() -> str:
    return secrets.token_urlsafe(32)


def _check(ok: bool, code: str, message: str) -> None:
    if not ok:
        raise ConfigError(code, message)


def _is_int(value: object) -> bool:
    return type(value) is int


def _optional_text(value: object) -> bool:
    return value is None or (type(value) is str and value != "")


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureConfig:
    """What to capture and how strictly to train on it; see `validate` for the codes.

    ``control_token`` is a secret: absent from ``repr``/``str`` and `summary`; error
    messages and warnings never quote it (it does travel in pickles, to reach workers).
    """

    segments: str = "terminal"
    """``"terminal"`` (only the terminal's chain) or ``"all"`` (one row per root)."""
    capture_routes: bool = False
    """Routes are required: a call the engine returns without routed experts fails
    (``routes_missing``). Routes the engine returns are staged either way."""
    model_is_moe: bool | None = None
    """None: unknown (route capture cannot be checked against the model)."""
    num_experts: int | None = None
    min_valid_fraction: float = 0.5
    max_seq_len: int = 32768
    return_token_ids: bool = False
    """Whether the gate may return token ids and logprobs to the harness."""
    stage_timeout_s: float = 30.0
    control_token: str | None = field(default=None, repr=False)
    control_token_env: str | None = None
    """Name of an environment variable holding the control token (the gate falls back to
    ``TOKCAP_CONTROL_TOKEN`` when neither this nor ``control_token`` is set)."""

    def __post_init__(self) -> None:
        self._check()

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.summary().items())
        return f"CaptureConfig({shown})"

    def _check(self) -> None:
        for name in ("capture_routes", "return_token_ids"):
            _check(type(getattr(self, name)) is bool, "bad_type", f"{name} must be a bool")
        _check(self.model_is_moe in (None, True, False), "bad_type", "model_is_moe: bool | None")
        _check(
            type(self.segments) is str and self.segments in SEGMENT_MODES,
            "bad_segments",
            f"segments must be one of {SEGMENT_MODES}: {self.segments!r}",
        )
        check_min_valid_fraction(self.min_valid_fraction)
        _check(
            _is_int(self.max_seq_len) and self.max_seq_len >= 1,
            "bad_max_seq_len",
            f"max_seq_len must be an int >= 1: {self.max_seq_len!r}",
        )
        experts = self.num_experts
        _check(
            experts is None or (_is_int(experts) and 1 <= experts <= _MAX_INT32_EXPERTS),
            "bad_num_experts",
            f"num_experts must be an int in [1, 2**31] or None: {experts!r}",
        )
        timeout = self.stage_timeout_s
        _check(
            type(timeout) in (int, float) and math.isfinite(timeout) and timeout > 0,
            "bad_timeout",
            f"stage_timeout_s must be a finite number > 0: {timeout!r}",
        )
        _check(_optional_text(self.control_token), "bad_token", "control_token: non-empty str")
        _check(_optional_text(self.control_token_env), "bad_token_env", "control_token_env: str")
        _check(
            self.control_token is None or self.control_token_env is None,
            "ambiguous_token",
            "set control_token or control_token_env, not both",
        )
        _check(
            not (self.capture_routes and self.model_is_moe is False),
            "routes_without_moe",
            "capture_routes needs a MoE model (model_is_moe is False)",
        )

    def validate(self) -> list[str]:
        """Re-check the configuration and return warnings for risky choices.

        Raises `ConfigError` (as the constructor does): ``bad_type``, ``bad_segments``,
        ``bad_min_valid_fraction``, ``bad_max_seq_len``, ``bad_num_experts``,
        ``bad_timeout``, ``bad_token``, ``bad_token_env``,
        ``ambiguous_token``, ``routes_without_moe``. The default config warns once
        (``segments="terminal"``); warnings never quote the token.
        """
        self._check()
        warnings: list[str] = []
        if self.segments == "terminal":
            warnings.append(
                'segments="terminal": when a rollout\'s history is rewritten, calls under its '
                'other roots are not trained (use segments="all" to train them)'
            )
        if self.capture_routes and self.model_is_moe is None:
            warnings.append("capture_routes: cannot check the model is MoE (model_is_moe=None)")
        if (
            self.capture_routes
            and self.num_experts is not None
            and dtype_for_experts(self.num_experts) == "int32"
        ):
            warnings.append(
                f"num_experts={self.num_experts} does not fit int16: routes are int32 (2x memory)"
            )
        if self.return_token_ids:
            warnings.append("return_token_ids: token ids and logprobs reach the harness")
        if self.min_valid_fraction == 0:
            warnings.append(
                "min_valid_fraction=0: groups are kept however few rollouts are valid "
                "(two valid rollouts are still required)"
            )
        return warnings

    def summary(self) -> dict[str, str | int | float | bool | None]:
        """Every field for logging, with ``control_token`` shown as ``"<redacted>"`` if set."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.control_token is not None:
            values["control_token"] = _REDACTED
        return values

    def with_derived(
        self, *, environ: Mapping[str, str], token_factory: Callable[[], str] = _new_token
    ) -> CaptureConfig:
        """A copy with the control token filled in; pure given its arguments.

        The token comes from ``environ[control_token_env]`` if that is named (missing or
        empty: `ConfigError` ``token_env_missing``; the copy then holds the token and no
        env name), else from ``token_factory()`` if unset; a set token is kept.
        """
        token, env = self.control_token, self.control_token_env
        if env is not None:
            token = environ.get(env)
            _check(
                bool(token), "token_env_missing", f"environment variable {env} is unset or empty"
            )
            env = None
        elif token is None:
            token = token_factory()
        return dataclasses.replace(self, control_token=token, control_token_env=env)


# ---- validators shared by every adapter's config class (attrs-compatible) ---------------


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Validator = Callable[[Any, Any, Any], None]
"""``check(instance, attribute, value)``: raises `ConfigError` ``bad_<attribute.name>``."""


def _bad(attribute: _Named, message: str) -> ConfigError:
    return ConfigError(f"bad_{attribute.name}", f"{attribute.name} {message}")


def at_least(low: int) -> Validator:
    """An int (not a bool) ``>= low``."""

    def check(_: object, attribute: _Named, value: Any) -> None:
        if not _is_int(value) or value < low:
            raise _bad(attribute, f"must be an int >= {low}: {value!r}")

    return check


def positive_number(_: object, attribute: _Named, value: Any) -> None:
    """A finite int or float (not a bool) ``> 0``."""
    if not (type(value) in (int, float) and math.isfinite(value) and value > 0):
        raise _bad(attribute, f"must be a finite number > 0: {value!r}")


def non_empty_text(_: object, attribute: _Named, value: Any) -> None:
    """A non-empty str."""
    if type(value) is not str or not value:
        raise _bad(attribute, f"must be a non-empty str: {value!r}")


def one_of(*allowed: object) -> Validator:
    """One of ``allowed`` (compared with ``==``)."""

    def check(_: object, attribute: _Named, value: Any) -> None:
        if value not in allowed:
            raise _bad(attribute, f"must be one of {allowed!r}: {value!r}")

    return check
