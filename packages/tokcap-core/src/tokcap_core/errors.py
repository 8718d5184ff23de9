"""Every error tokcap-core raises.

One root (`TokcapError`), split by who is at fault, each with a stable ``code``.
"""

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
from ._renamed import renamed_names
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

__getattr__ = renamed_names(__name__, {"ReplaySlotError": SlotError})
"""``ReplaySlotError`` was renamed `SlotError` ("replay" names the ledger's replay alone)."""
