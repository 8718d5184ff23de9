"""Sinks: the `TokenSink` protocol, the in-process `MemorySink`, the sink errors, and
`SinkPlugin` (how a served gate opens a sink by name)."""

from ._errors import (
    MissingRows,
    SinkError,
)
from ._sink import (
    ManifestSource,
    MemorySink,
    TokenSink,
)
from ._sink_plugin import SINK_PLUGIN_GROUP, SinkPlugin

__all__ = [
    "SINK_PLUGIN_GROUP",
    "ManifestSource",
    "MemorySink",
    "MissingRows",
    "SinkError",
    "SinkPlugin",
    "TokenSink",
]
