"""Sinks: the `TokenSink` protocol, the in-process `MemorySink` and the sink errors."""

from ._errors import (
    MissingRows,
    SinkError,
)
from ._sink import (
    ManifestSource,
    MemorySink,
    TokenSink,
)

__all__ = [
    "ManifestSource",
    "MemorySink",
    "MissingRows",
    "SinkError",
    "TokenSink",
]
