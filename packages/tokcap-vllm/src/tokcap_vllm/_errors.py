"""Typed gate errors: each carries a stable ``code`` and the HTTP status it maps to."""

from __future__ import annotations

from typing import ClassVar

from tokcap_core import TokcapError

__all__ = ["BadRequest", "GateError", "RolloutConflict", "RolloutNotFound", "Unsupported"]


class GateError(TokcapError):
    """Root of the errors the gate answers with an HTTP error body."""

    status: ClassVar[int] = 500


class BadRequest(GateError, ValueError):
    """The request is malformed: bad JSON body, bad rollout id, bad field types."""

    status = 400


class Unsupported(GateError, ValueError):
    """The request is valid OpenAI but cannot be captured (``n > 1``, batched prompts, ...)."""

    status = 400


class RolloutNotFound(GateError, KeyError):
    """The rollout id names no rollout this gate holds."""

    status = 404

    def __str__(self) -> str:
        return TokcapError.__str__(self)


class RolloutConflict(GateError, RuntimeError):
    """The rollout is closed (or its parent never committed) so the call cannot be captured."""

    status = 409
