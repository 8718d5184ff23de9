"""What a close request means to the ledger, and what a failed close answers.

The control plane's close routes (one rollout, or many in one durable write) share these:
the witnesses a close body names, checked before the close drains anything
(`close_witnesses`); the core errors a gate operation raises mapped to control-plane
statuses (`ledger_errors`); and a batch item's failure as the status and code its own
close would have answered (`as_gate_error`, `failed_outcome`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokcap_core import LedgerProtocolError
from tokcap_core.errors import InvalidId
from tokcap_core.ledger import Closed, Witnesses

from ..api import CloseOutcome, CloseProblem, WitnessBody
from ..errors import BadRequest, ControlUnavailable, GateError, InvalidBody, RolloutConflict
from ..fingerprints import output_fingerprint
from ..persist import LedgerFileError

__all__ = ["as_gate_error", "close_witnesses", "failed_outcome", "is_fingerprint", "ledger_errors"]


def close_witnesses(reward: float | None, w: WitnessBody | None) -> Witnesses:
    """The ledger's witnesses for a close body; `InvalidBody` for a bad fingerprint or
    reward (refused before the close drains anything)."""
    fingerprint = None
    if w is not None:
        if w.content_fingerprint is not None and (w.content is not None or w.tool_calls):
            raise InvalidBody("bad_body", "give content or content_fingerprint, not both")
        fingerprint = w.content_fingerprint
        if fingerprint is not None and not is_fingerprint(fingerprint):
            raise InvalidBody(
                "bad_content_fingerprint",
                "content_fingerprint is 64 lowercase hex characters (output_fingerprint)",
            )
        if w.content is not None or w.tool_calls:
            with ledger_errors():
                fingerprint = output_fingerprint(w.content, w.tool_calls)
    with ledger_errors():
        witnesses = Witnesses(
            response_id=w.response_id if w is not None else None,
            content_fingerprint=fingerprint,
        )
        Closed(reward=reward, witnesses=witnesses)
    return witnesses


def as_gate_error(error: Exception) -> GateError:
    """The control-plane error a failed close of one rollout answers with."""
    if isinstance(error, GateError):
        return error
    try:
        with ledger_errors():
            raise error
    except GateError as e:
        return e
    except Exception:  # reported for this rollout, as the single close's 500 would be
        return GateError("gate_failed", f"the close failed ({type(error).__name__})")


def failed_outcome(rollout_id: str, error: GateError) -> CloseOutcome:
    problem = CloseProblem(status=type(error).status, code=error.code, message=error.message)
    return CloseOutcome(rollout_id=rollout_id, error=problem)


@contextmanager
def ledger_errors() -> Iterator[None]:
    """Map core errors raised by a gate operation to control-plane statuses."""
    try:
        yield
    except LedgerProtocolError as e:
        if e.code == "bad_event_field":
            raise InvalidBody("bad_body", e.message) from e
        raise RolloutConflict(e.code, e.message) from e
    except InvalidId as e:
        raise BadRequest(e.code, e.message) from e
    except LedgerFileError as e:
        raise ControlUnavailable(e.code, e.message) from e


def is_fingerprint(text: str) -> bool:
    """Whether ``text`` can be a fingerprint the gate made (hex SHA-256): one that cannot
    would only ever miss, and poison the rollout at its receipt."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
