"""Every error tokcap-vllm raises: the gate's answers (each with the HTTP status it answers
with), the control-plane client's (`ControlPlaneError` and subclasses: the status and code
the control plane answered), the ledger file's and the weight push's."""

from __future__ import annotations

from typing import ClassVar

from tokcap_core import TokcapError

__all__ = [
    "BadRequest",
    "CallNotServed",
    "CallStateError",
    "ControlAuthError",
    "ControlConflict",
    "ControlNotFound",
    "ControlPlaneError",
    "ControlRequestError",
    "ControlUnavailable",
    "ControlUnreachable",
    "Forbidden",
    "GateError",
    "InvalidBody",
    "LedgerFileError",
    "MethodNotAllowed",
    "RolloutConflict",
    "RolloutNotFound",
    "SinkUnavailable",
    "TooLarge",
    "TooManyRollouts",
    "Unauthorized",
    "Unsupported",
    "UnsupportedTokenizer",
    "WeightPushError",
    "WeightSyncError",
    "WeightsUnavailable",
]


class GateError(TokcapError):
    """Root of the errors the gate answers with an HTTP error body."""

    status: ClassVar[int] = 500


class BadRequest(GateError, ValueError):
    """The request is malformed: bad JSON body, bad rollout id, bad field types."""

    status = 400


class Unsupported(GateError, ValueError):
    """The request is valid OpenAI but cannot be captured (``n > 1``, batched prompts, ...)."""

    status = 400


class UnsupportedTokenizer(Unsupported):
    """The server's tokenizer or chat template cannot be captured (the message names it);
    every captured call is refused with ``tokenizer_unsupported``, the first one included."""


class RolloutNotFound(GateError, KeyError):
    """The rollout id names no rollout this gate holds."""

    status = 404

    def __str__(self) -> str:
        return TokcapError.__str__(self)


class RolloutConflict(GateError, RuntimeError):
    """The rollout is closed (or its parent never committed) so the call cannot be captured."""

    status = 409


class Unauthorized(GateError, PermissionError):
    """A control-plane request without the right bearer token (the token is never echoed)."""

    status = 401


class Forbidden(GateError, PermissionError):
    """A route the gate refuses even with the token (``route_refused``: what it would do no
    rule of the gate could record)."""

    status = 403


class InvalidBody(GateError, ValueError):
    """A control-plane body that decodes but says something invalid (both terminal ids, ...)."""

    status = 422


class TooLarge(GateError, ValueError):
    """A body or a manifest over its bound (``body_too_large``, ``manifest_too_large``, ...):
    refused, never truncated."""

    status = 413


class ControlUnavailable(GateError, RuntimeError):
    """The control plane cannot serve: no token configured, or the ledger file failed."""

    status = 503


class TooManyRollouts(GateError, RuntimeError):
    """``GateConfig.max_open_rollouts`` rollouts are open: close some before starting more."""

    status = 503


class WeightsUnavailable(GateError, RuntimeError):
    """A weight push failed after generation paused, so the engine may hold half-updated
    weights: captured calls are refused (``weights_unavailable``) until a full push succeeds."""

    status = 503


class CallNotServed(GateError, RuntimeError):
    """The engine's output for this call cannot be held as served, so the harness gets this
    error instead of a completion: ``call_aborted`` (the engine aborted the request: a
    weight push or vLLM's ``/pause`` in abort mode; retry it), ``capture_failed``,
    ``ledger_write_failed`` (the ledger file cannot record it), or ``media_tensors_unseen``
    (vLLM sent no tensors for an image the gate never saw processed; retry it: they are
    sent with the retry)."""

    status = 503


class SinkUnavailable(GateError, RuntimeError):
    """The sink cannot take staged calls now (its TransferQueue is gone, or being attached
    again): captured calls are refused before admission (``sink_unavailable``) instead of
    answered with a completion whose staging would fail."""

    status = 503


class MethodNotAllowed(GateError, ValueError):
    """A control route called with the wrong HTTP method."""

    status = 405


# ---- what the client raises -------------------------------------------------------------


class ControlPlaneError(TokcapError, RuntimeError):
    """A control-plane call failed; ``status`` is the HTTP status (0: no answer came back)
    and ``code`` the server's reason code."""

    def __init__(self, code: str, message: str = "", status: int = 0) -> None:
        super().__init__(code, message)
        self.args = (code, message, status)
        self.status = status

    @staticmethod
    def of_status(status: int, code: str, message: str = "") -> ControlPlaneError:
        """The typed error for an answer of ``status`` with the gate's ``code``: 401
        `ControlAuthError`, 404 `ControlNotFound`, 409 `ControlConflict`, 5xx
        `ControlUnreachable`, any other `ControlRequestError`."""
        kind = _BY_STATUS.get(status)
        if kind is None:
            kind = ControlUnreachable if status >= 500 else ControlRequestError
        return kind(code, message, status)


class ControlAuthError(ControlPlaneError):
    """401: the token is missing or wrong."""


class ControlNotFound(ControlPlaneError):
    """404: no such rollout (or route)."""


class ControlConflict(ControlPlaneError):
    """409: the ledger refused the transition (``rollout_closed``, ...)."""


class ControlRequestError(ControlPlaneError):
    """400, 405, 413, 422: the request itself is wrong."""


class ControlUnreachable(ControlPlaneError):
    """No usable answer after the retries: transport failure or 5xx."""


_BY_STATUS: dict[int, type[ControlPlaneError]] = {
    401: ControlAuthError,
    404: ControlNotFound,
    409: ControlConflict,
}


# ---- the call table's, the ledger file's and the weight push's ------------------------


class CallStateError(TokcapError, RuntimeError):
    """The gate asked a call or a rollout for a step its phase does not allow (a gate bug,
    contained)."""


class LedgerFileError(TokcapError, RuntimeError):
    """The ledger file cannot be trusted (a corrupt record before the tail, a broken chain)
    or cannot be written (``ledger_write_failed``, ``ledger_sync_failed``); ``detail`` names
    the OS error (``ENOSPC``, ``EFBIG``, ...) when there is one."""

    def __init__(self, code: str, message: str = "", detail: str | None = None) -> None:
        super().__init__(code, message)
        self.args = (code, message, detail)
        self.detail = detail


class WeightPushError(TokcapError, ValueError):
    """A push refused before anything was loaded: the engine serves what it served before.

    Codes: ``missing_tensors`` (a partial push), ``unknown_tensors``, ``shape_mismatch``,
    ``dtype_mismatch``, ``not_a_tensor``, ``non_finite_weights``, ``bad_version``,
    ``version_not_increasing``, ``bad_mode``, ``push_in_progress``, ``not_pushing``; for a
    push file (`tokcap_vllm.transfer._shm`): ``push_file_name``, ``push_file_missing``,
    ``push_file_link``, ``push_file_not_regular``, ``push_file_linked``,
    ``push_file_unreadable``, ``push_file_size``, ``push_file_changed``, ``bad_entry``,
    ``duplicate_tensors``, ``entry_out_of_file``.
    """


class WeightSyncError(TokcapError, RuntimeError):
    """The engine side of a push failed (``stage_failed``: nothing loaded, state unchanged;
    ``<step>_failed`` after the pause: the state is FAILED), or the engine cannot take
    pushes at all (``extension_missing``, ``spec_unavailable``)."""
