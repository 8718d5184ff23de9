"""Every error tokcap-core raises.

One root (`TokcapError`), split by who is at fault, each with a stable ``code``.
"""

import warnings

from ._errors import (
    ConfigError,
    InvalidId,
    InvalidStagedCall,
    LedgerProtocolError,
    ManifestError,
    MetadataViolation,
    MissingRows,
    ReassemblyError,
    RoutesError,
    SinkError,
    SlotError,
    TokcapError,
    VerificationError,
)
from ._rpc import (
    InvalidRequest,
)
from .advantages import (
    AdvantageInputError,
)

__all__ = [
    "AdvantageInputError",
    "ConfigError",
    "InvalidId",
    "InvalidRequest",
    "InvalidStagedCall",
    "LedgerProtocolError",
    "ManifestError",
    "MetadataViolation",
    "MissingRows",
    "ReassemblyError",
    "RoutesError",
    "SinkError",
    "SlotError",
    "TokcapError",
    "VerificationError",
]

_RENAMED = {"ReplaySlotError": "SlotError"}
"""Old name -> new name (the word "replay" is kept for the ledger's replay alone)."""


def __getattr__(name: str) -> object:
    """Deprecated names: ``ReplaySlotError`` (now `SlotError`)."""
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"{__name__}.{name} is deprecated; use {new}", DeprecationWarning, stacklevel=2
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
