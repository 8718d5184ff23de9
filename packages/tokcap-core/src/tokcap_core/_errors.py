"""One error root for tokcap, split by who is at fault.

Every error carries a stable ``code`` (a short snake_case string that callers
and metrics may match on) and inherits the stdlib type it narrows. Errors cross
Ray and process boundaries, so they stay picklable: ``args`` is always
``(code, message)``, exactly the constructor's signature.
"""

from __future__ import annotations


class TokcapError(Exception):
    """Root of every error tokcap raises on purpose."""

    code: str

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}" if self.message else f"[{self.code}]"


class InvalidId(TokcapError, ValueError):
    """A rollout id, call id or staging key does not match its grammar."""


class InvalidStagedCall(TokcapError, ValueError):
    """A staged call's fields break one of its invariants."""


class LedgerProtocolError(TokcapError, ValueError):
    """The caller broke the custody protocol (an illegal ledger transition)."""


class VerificationError(TokcapError, ValueError):
    """The data is wrong: a digest, hash, length or link does not check out."""


class ManifestError(VerificationError):
    """A manifest could not be decoded: bad JSON, unknown fields, wrong types, too large."""


class ReassemblyError(VerificationError):
    """Staged calls could not be reassembled into training rows for a receipt."""


class RoutesError(TokcapError, ValueError):
    """A routed-experts envelope or array is malformed (shape, dtype, length, range)."""


class SlotError(TokcapError, ValueError):
    """An illegal group-slot transition (e.g. abort of a READY slot, double commit)."""


class MetadataViolation(TokcapError, TypeError):
    """An RPC payload carries token data where only metadata is allowed."""


class ConfigError(TokcapError, ValueError):
    """A configuration combination that tokcap does not support."""


class SinkError(TokcapError, RuntimeError):
    """A token sink failed to store, fetch or clear rows."""


class MissingRows(SinkError, KeyError):
    """A sink get named keys that the sink does not hold; ``missing`` lists them."""

    def __init__(self, code: str, message: str = "", missing: tuple[str, ...] = ()) -> None:
        super().__init__(code, message)
        self.args = (code, message, tuple(missing))
        self.missing = tuple(missing)

    def __str__(self) -> str:
        return TokcapError.__str__(self)
