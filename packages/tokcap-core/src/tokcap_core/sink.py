"""Sinks: where staged calls and training rows live between the gate and the trainer.

`TokenSink` is the protocol every sink implements (``tokcap_tq.TQSink`` over
TransferQueue; `MemorySink` here, in-process, for single-process use and as the
reference the conformance tests hold every other sink to). The contract:
- ``put``: idempotent for identical content under a key; different content under a
  key already held raises `SinkError` (``conflicting_put``) and stores nothing of the batch;
- ``get``: all keys or `MissingRows` naming the missing ones — never fewer rows;
- ``clear``: frees the keys; keys already gone are ignored, so a retried clear is safe;
- training rows: ``publish`` / ``fetch`` / ``clear_rows``, keyed by `training_key`, same rules;
- ``staged_keys`` / ``row_keys``: every key held, for leak checks (async on every sink).

`MediaStore` is what a sink that holds images adds (`MemorySink`, ``tokcap_tq.TQSink``):
each image's processed tensors as one blob (``tokcap_core.staged.media_blob``) keyed by
its ``tensors_digest``, stored once however many calls and rows name it. Its rules are
the same (``put_media`` of an identical blob is a no-op, of a different one under a held
digest ``conflicting_put`` and nothing of the batch stored; ``get_media`` all or
`MissingRows`; ``clear_media`` ignores absent digests; ``media_keys`` for leak checks).
A sink without it keeps working for text; a gate serving images needs it. `fetch_media`
is how a trainer reads blobs back: every blob checked against its digest before use.

`SinkPlugin` is how a served gate opens a sink it was named without importing its
package: adapters never depend on each other, yet ``tokcap-vllm serve --tokcap-sink tq`` must stage
into TransferQueue. The sink's package registers a `SinkPlugin` under the entry-point
group `SINK_PLUGIN_GROUP` (``tokcap.sinks``), named as the gate's ``--tokcap-sink`` value;
the gate finds it with `importlib.metadata.entry_points` and knows nothing else about it.
A plugin sink is read by other processes (a trainer, a reassembler pool), so a gate
requires its control token whenever one is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from ._errors import MissingRows, SinkError
from ._manifest import Manifest
from ._media import TensorBytes
from ._media_blob import verify_media
from ._rows import TrainingRow
from ._staged import StagedCall
from .ids import StagingKey, TrainingKey

__all__ = [
    "SINK_PLUGIN_GROUP",
    "ManifestSource",
    "MediaStore",
    "MemorySink",
    "MissingRows",
    "SinkError",
    "SinkHealth",
    "SinkPlugin",
    "TokenSink",
    "fetch_media",
]

_T = TypeVar("_T")
_K = TypeVar("_K", bound=str)


@runtime_checkable
class TokenSink(Protocol):
    """Stores staged calls (staging partition) and training rows (training partition)."""

    async def put(self, calls: Sequence[StagedCall]) -> None:
        """Store staged calls under their staging keys."""
        ...

    async def get(self, keys: Sequence[StagingKey]) -> list[StagedCall]:
        """The staged calls for ``keys``, in order; `MissingRows` if any is absent."""
        ...

    async def clear(self, keys: Sequence[StagingKey]) -> None:
        """Free staged calls; absent keys are ignored."""
        ...

    async def publish(self, rows: Mapping[TrainingKey, TrainingRow]) -> None:
        """Store training rows under their training keys."""
        ...

    async def fetch(self, keys: Sequence[TrainingKey]) -> list[TrainingRow]:
        """The training rows for ``keys``, in order; `MissingRows` if any is absent."""
        ...

    async def clear_rows(self, keys: Sequence[TrainingKey]) -> None:
        """Free training rows; absent keys are ignored."""
        ...

    async def staged_keys(self) -> list[StagingKey]:
        """Every staging key held (for leak checks and sweeps)."""
        ...

    async def row_keys(self) -> list[TrainingKey]:
        """Every training key held (for leak checks and sweeps)."""
        ...


@runtime_checkable
class MediaStore(Protocol):
    """Stores media blobs by tensors digest (see the module docstring for the rules)."""

    async def put_media(self, blobs: Mapping[str, bytes]) -> None:
        """Store blobs under their digests; a held identical blob is kept."""
        ...

    async def get_media(self, digests: Sequence[str]) -> list[bytes]:
        """The blobs of ``digests``, in order; `MissingRows` if any is absent."""
        ...

    async def clear_media(self, digests: Sequence[str]) -> None:
        """Free blobs; absent digests are ignored."""
        ...

    async def media_keys(self) -> list[str]:
        """Every digest held (for leak checks and sweeps)."""
        ...


async def fetch_media(
    store: MediaStore, digests: Sequence[str]
) -> dict[str, tuple[TensorBytes, ...]]:
    """The processed tensors of ``digests``, read from ``store`` and each verified against
    its digest (``tokcap_core.staged.verify_media``): `MissingRows` for an absent blob,
    `VerificationError` ``media_tensors_mismatch`` naming the digest whose blob does not
    hold the tensors it names."""
    unique = list(dict.fromkeys(digests))
    blobs = await store.get_media(unique)
    return verify_media(dict(zip(unique, blobs, strict=True)), unique)


@runtime_checkable
class ManifestSource(Protocol):
    """Serves a rollout's manifest (a gate's control plane, a file, a test double)."""

    async def manifest(self, rollout_id: str) -> Manifest:
        """The current manifest of ``rollout_id``."""
        ...


SINK_PLUGIN_GROUP: Final = "tokcap.sinks"
"""The entry-point group sink plugins are registered under (name = the sink's name)."""


@runtime_checkable
class SinkHealth(Protocol):
    """A sink that can say it cannot take staged calls now (the service behind it is gone,
    or being attached again): a served gate reads `problem` before admitting each captured
    call (refusing it rather than answering a call whose staging would fail) and in its
    health."""

    @property
    def problem(self) -> str | None:
        """None while the sink can take staged calls; else why not, in a few words."""
        ...


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
        failing to attach raises (the server does not start). Gates outlive the services
        they attach to: a plugin whose service can be replaced (a trainer's TransferQueue)
        attaches to the new one while the gate serves, its sinks saying meanwhile what is
        wrong (`SinkHealth`).
        """
        ...


class MemorySink:
    """An in-process `TokenSink` and `MediaStore` (dicts); the reference for sink
    conformance tests."""

    def __init__(self) -> None:
        self._staged: dict[StagingKey, StagedCall] = {}
        self._rows: dict[TrainingKey, TrainingRow] = {}
        self._media: dict[str, bytes] = {}

    async def put(self, calls: Sequence[StagedCall]) -> None:
        """Store staged calls under their staging keys (all or nothing)."""
        _store(self._staged, {c.key: c for c in calls}, what="staged call")

    async def get(self, keys: Sequence[StagingKey]) -> list[StagedCall]:
        """The staged calls for ``keys``, in order; `MissingRows` if any is absent."""
        return _load(self._staged, keys)

    async def clear(self, keys: Sequence[StagingKey]) -> None:
        """Free staged calls; absent keys are ignored."""
        _drop(self._staged, keys)

    async def publish(self, rows: Mapping[TrainingKey, TrainingRow]) -> None:
        """Store training rows under their keys (all or nothing); a key must be its row's key."""
        for key, row in rows.items():
            if key != row.key:
                raise SinkError("key_mismatch", f"row {row.key} offered under {key}")
        _store(self._rows, dict(rows), what="training row")

    async def fetch(self, keys: Sequence[TrainingKey]) -> list[TrainingRow]:
        """The training rows for ``keys``, in order; `MissingRows` if any is absent."""
        return _load(self._rows, keys)

    async def clear_rows(self, keys: Sequence[TrainingKey]) -> None:
        """Free training rows; absent keys are ignored."""
        _drop(self._rows, keys)

    async def staged_keys(self) -> list[StagingKey]:
        """Every staging key held (for leak checks)."""
        return list(self._staged)

    async def row_keys(self) -> list[TrainingKey]:
        """Every training key held (for leak checks)."""
        return list(self._rows)

    async def put_media(self, blobs: Mapping[str, bytes]) -> None:
        """Store media blobs under their digests (all or nothing)."""
        _store(self._media, {k: bytes(v) for k, v in blobs.items()}, what="media blob")

    async def get_media(self, digests: Sequence[str]) -> list[bytes]:
        """The blobs of ``digests``, in order; `MissingRows` if any is absent."""
        return _load(self._media, digests)

    async def clear_media(self, digests: Sequence[str]) -> None:
        """Free media blobs; absent digests are ignored."""
        _drop(self._media, digests)

    async def media_keys(self) -> list[str]:
        """Every digest held (for leak checks)."""
        return list(self._media)


def _store(table: dict[_K, _T], batch: Mapping[_K, _T], *, what: str) -> None:
    for key, value in batch.items():
        held = table.get(key)
        if held is not None and held != value:
            raise SinkError("conflicting_put", f"a different {what} is already stored under {key}")
    table.update(batch)


def _drop(table: dict[_K, _T], keys: Sequence[_K]) -> None:
    for key in keys:
        table.pop(key, None)


def _load(table: Mapping[_K, _T], keys: Sequence[_K]) -> list[_T]:
    missing = tuple(k for k in keys if k not in table)
    if missing:
        raise MissingRows(
            "missing_rows", f"{len(missing)} of {len(keys)} keys are not in the sink", missing
        )
    return [table[k] for k in keys]
