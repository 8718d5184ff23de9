"""`SinkPlugin`: how a served gate opens a sink it was named, without importing its package.

Adapters never depend on each other, yet ``tokcap-vllm serve --tokcap-sink tq`` must stage
into TransferQueue. The sink's package registers a `SinkPlugin` under the entry-point
group `SINK_PLUGIN_GROUP` (``tokcap.sinks``), named as the gate's ``--tokcap-sink`` value;
the gate finds it with `importlib.metadata.entry_points` and knows nothing else about it.
A plugin sink is read by other processes (a trainer, a reassembler pool), so a gate
requires its control token whenever one is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Protocol

from ._sink import TokenSink

__all__ = ["SINK_PLUGIN_GROUP", "SinkPlugin"]

SINK_PLUGIN_GROUP: Final = "tokcap.sinks"
"""The entry-point group sink plugins are registered under (name = the sink's name)."""


class SinkPlugin(Protocol):
    """A sink a served gate can open by name.

    ``config_types`` are config classes (attrs or dataclasses, validating in their
    constructor with `ConfigError` ``bad_<field>``) whose fields become the gate's
    options (``--tokcap-<field>``, ``TOKCAP_<FIELD>``); `sink` and `attach` get one
    instance of each, in that order.
    """

    @property
    def config_types(self) -> tuple[type[Any], ...]:
        """The config classes whose fields are this sink's options."""
        ...

    def sink(self, configs: Sequence[Any]) -> TokenSink:
        """The sink (cheap: no connection is made until `attach`)."""
        ...

    def attach(self, configs: Sequence[Any]) -> AbstractAsyncContextManager[None]:
        """Connect to the running sink for the gate's lifetime (never start or own it).

        Entered once before the gate serves; waiting for the sink is bounded and logged;
        failing to attach raises (the server does not start).
        """
        ...
