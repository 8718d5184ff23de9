"""A served gate: its config, its sink and how it attaches, from options or ``TOKCAP_*``.

``tokcap-vllm serve`` turns its ``--tokcap-*`` options into ``TOKCAP_<FIELD>`` variables
and vLLM builds `GateMiddleware` by import path, which reads them back here; a
``--middleware`` or plugin user sets the same variables. The sink is chosen by name
(``sink``, required): ``memory`` keeps staged calls in this process, where no trainer
can read them (the start-up log and ``/tokcap/v1/health`` say so); any other name is a
`tokcap_core.sink.SinkPlugin` registered under the ``tokcap.sinks`` entry-point group
(tokcap-tq registers ``tq``), whose config classes add their fields as options. A
plugin sink is read by other processes, so it needs the control token.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from importlib.metadata import entry_points

import attrs

from tokcap_core import ConfigError, MemorySink
from tokcap_core.config import non_empty_text
from tokcap_core.sink import SINK_PLUGIN_GROUP, SinkPlugin, TokenSink

from ..persist import LedgerFileError, lock_ledger_file
from ._config import GateConfig, gate_options
from ._gate import Gate
from ._options import Option, build, from_environ, options_of

__all__ = [
    "MEMORY_SINK",
    "MEMORY_SINK_WARNING",
    "ServeOptions",
    "ServedGate",
    "describe_sink",
    "gate_help",
    "served_gate",
    "served_options",
    "sink_names",
]

_log = logging.getLogger("tokcap_vllm.gate")

MEMORY_SINK = "memory"
MEMORY_SINK_WARNING = (
    "memory_sink: staged tokens stay in this server's memory; no trainer can read them "
    "(serve with --tokcap-sink tq to stage into TransferQueue)"
)


@attrs.frozen(kw_only=True)
class ServeOptions:
    """What a served gate adds to `GateConfig`: where it stages."""

    sink: str = attrs.field(validator=non_empty_text)
    """``memory`` (no trainer can read it) or an installed sink plugin (``tq``)."""


def sink_names() -> list[str]:
    """``memory`` and every installed sink plugin's name (nothing is imported)."""
    return [MEMORY_SINK, *sorted(ep.name for ep in entry_points(group=SINK_PLUGIN_GROUP))]


def _plugin(name: str) -> SinkPlugin:
    found = [ep for ep in entry_points(group=SINK_PLUGIN_GROUP) if ep.name == name]
    if not found:
        raise ConfigError(
            "bad_sink",
            f"--tokcap-sink (TOKCAP_SINK): no sink named {name!r}; installed: "
            + ", ".join(sink_names()),
        )
    plugin: SinkPlugin = found[0].load()
    return plugin


def served_options(sink: str | None) -> list[Option]:
    """The gate's options, ``--tokcap-sink``, and the named sink plugin's options (loaded)."""
    options = [*gate_options(), *options_of(ServeOptions)]
    if sink is not None and sink != MEMORY_SINK:
        for config_type in _plugin(sink).config_types:
            options.extend(options_of(config_type))
    return options


@attrs.frozen
class ServedGate:
    """A gate with its sink, and what attaches it (enter before the gate serves)."""

    gate: Gate
    sink_name: str
    attach: Callable[[], AbstractAsyncContextManager[None]]


def served_gate(
    texts: Mapping[str, str] | None = None,
    *,
    environ: Mapping[str, str],
    build_gate: bool = True,
) -> ServedGate | None:
    """The served gate ``texts`` (``{field: text}``) or else the ``TOKCAP_*`` variables ask for.

    Raises `ConfigError` naming the option at fault: ``bad_sink`` when no sink was chosen
    or none is installed by that name, ``bad_<field>`` for a bad value, ``token_required``
    for a plugin sink without a control token. With ``build_gate=False`` only checks
    (nothing is opened) and returns None.
    """
    if texts is None:
        sink = environ.get("TOKCAP_SINK")
        texts = from_environ(environ, served_options(sink))
    if not texts.get("sink"):
        raise ConfigError(
            "bad_sink",
            "--tokcap-sink (TOKCAP_SINK) is required: one of " + ", ".join(sink_names()) + " ("
            "memory keeps staged tokens where no trainer can read them)",
        )
    options = served_options(texts["sink"])
    choice: ServeOptions = build(ServeOptions, options, texts)
    config = GateConfig.from_texts(texts)
    plugin = None if choice.sink == MEMORY_SINK else _plugin(choice.sink)
    configs = [] if plugin is None else [build(t, options, texts) for t in plugin.config_types]
    if plugin is not None and config.resolve_token(environ) is None:
        raise ConfigError(
            "token_required",
            f"--tokcap-sink {choice.sink} stages where other processes read: set the control "
            "token in TOKCAP_CONTROL_TOKEN (or the variable --tokcap-control-token-env "
            "names, or a file: --tokcap-control-token-file)",
        )
    if not build_gate:
        _check_ledger_path(config)
        return None
    if plugin is None:
        return ServedGate(Gate(config, sink=MemorySink()), MEMORY_SINK, _memory_attach)
    return ServedGate(
        Gate(config, sink=plugin.sink(configs)), choice.sink, lambda: plugin.attach(configs)
    )


def _check_ledger_path(config: GateConfig) -> None:
    """`ConfigError` if the ledger path is a directory or another gate holds its file (the
    lock is taken and let go: the server takes it for good when it builds the gate)."""
    if config.ledger_path is None:
        return
    try:
        os.close(lock_ledger_file(config.ledger_path))
    except LedgerFileError as e:
        raise ConfigError(e.code, f"--tokcap-ledger-path (TOKCAP_LEDGER_PATH): {e.message}") from e


@contextlib.asynccontextmanager
async def _memory_attach() -> AsyncIterator[None]:
    _log.warning("tokcap gate: %s", MEMORY_SINK_WARNING)
    yield


def describe_sink(sink: TokenSink) -> tuple[str, list[str]]:
    """``(name, warnings)`` for ``/tokcap/v1/health``: the in-memory sink is unreadable."""
    if type(sink) is MemorySink:
        return MEMORY_SINK, [MEMORY_SINK_WARNING]
    return type(sink).__name__, []


def gate_help() -> list[str]:
    """The help lines of every option; installed sink plugins are imported for theirs."""
    lines = ["tokcap gate options (each also a TOKCAP_<FIELD> environment variable):"]
    lines += [o.describe() for o in [*gate_options(), *options_of(ServeOptions)]]
    for name in sink_names()[1:]:
        lines += ["", f"with --tokcap-sink {name}:"]
        lines += [o.describe() for t in _plugin(name).config_types for o in options_of(t)]
    return lines
