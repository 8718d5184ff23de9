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
    ReplaySlotError,
    RoutesError,
    SinkError,
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
    "ReplaySlotError",
    "RoutesError",
    "SinkError",
    "TokcapError",
    "VerificationError",
]
