"""`TQSink`: the core's `TokenSink` over TransferQueue's async KV API.

TransferQueue is forgiving where a sink must not be: a get that misses keys drops them,
a get of a field some keys lack returns the shared fields only, and a put over a held key
overwrites it. `TQSink` turns each into the contract's error (`MissingRows`,
``field_mismatch``, ``conflicting_put``) at the cost of raw TQ's own round trips (see
``_partition``). Every TQ call is a native coroutine awaited on the caller's loop;
``clear`` runs under a shield, so a cancelled clear still completes and its rows never
stay unreadable-but-unfreed. Every operation (``put``, ``get``, ``clear``, the key
listings) has a deadline (``op_timeout_s``): TQ's client waits forever on a dead storage
unit or controller, and a sink must fail with a typed `SinkError` (``tq_timeout``)
instead. A clear that times out may have left its keys unfreed, so callers that track
owed keys retry it. A put that times out or is cancelled after TQ registered its keys
may leave them registered and unwritten: they read as missing, are listed by
``staged_keys`` and are freed by a clear or rewritten by a retried put.

Media blobs (``tokcap_core.sink.MediaStore``) live in a third partition, keyed by tensors
digest, under the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import attrs

from tokcap_core import ConfigError, SinkError, StagedCall, TrainingRow
from tokcap_core.config import non_empty_text, positive_number
from tokcap_core.ids import StagingKey, TrainingKey

from ._codec import (
    MEDIA_FIELDS,
    STAGING_FIELDS,
    TRAINING_FIELDS,
    decode_media,
    decode_own_staged,
    decode_rows,
    encode_media,
    encode_rows,
    encode_staged,
)
from ._deps import tq
from ._partition import Partition

__all__ = ["TQSink", "TQSinkConfig"]


def _no_slash(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if "/" in value:
        raise ConfigError(f"bad_{attribute.name}", f"{attribute.name} must not contain '/'")


_PARTITION_NAME = [non_empty_text, _no_slash]


@attrs.frozen(kw_only=True)
class TQSinkConfig:
    """Where a `TQSink` keeps its rows (one TQ partition for staged calls, one for training
    rows, one for media blobs) and how long any one operation may take before it fails
    with ``tq_timeout``.

    A bad value raises `tokcap_core.ConfigError` ``bad_<field>`` (``bad_training_partition``
    or ``bad_media_partition`` when two partitions share a name).
    """

    staging_partition: str = attrs.field(default="tokcap_staging", validator=_PARTITION_NAME)
    training_partition: str = attrs.field(default="tokcap_training", validator=_PARTITION_NAME)
    op_timeout_s: float = attrs.field(default=60.0, validator=positive_number)
    media_partition: str = attrs.field(default="tokcap_media", validator=_PARTITION_NAME)

    def __attrs_post_init__(self) -> None:
        if self.staging_partition == self.training_partition:
            raise ConfigError(
                "bad_training_partition", "training_partition must differ from staging_partition"
            )
        if self.media_partition in (self.staging_partition, self.training_partition):
            raise ConfigError(
                "bad_media_partition", "media_partition must differ from the other partitions"
            )


class TQSink:
    """A `TokenSink` and `MediaStore` over TransferQueue (see the module docstring for the
    guarantees).

    TransferQueue must be initialised in this process (``local_tq``, ``tq.init()``), or use
    `TQSink.connect`, which attaches to a running TransferQueue in a worker thread.
    """

    def __init__(self, config: TQSinkConfig | None = None) -> None:
        self.config = config or TQSinkConfig()
        self.problem: str | None = None
        """`tokcap_core.sink.SinkHealth`: set by a served gate's attachment
        (`tokcap_tq._served`) while its TransferQueue is gone or being attached again."""
        self._staging: Partition[StagingKey, StagedCall] = Partition(
            self.config.staging_partition,
            STAGING_FIELDS,
            encode_staged,
            decode_own_staged,
            self.config.op_timeout_s,
        )
        self._training: Partition[TrainingKey, TrainingRow] = Partition(
            self.config.training_partition,
            TRAINING_FIELDS,
            encode_rows,
            decode_rows,
            self.config.op_timeout_s,
        )
        self._media: Partition[str, bytes] = Partition(
            self.config.media_partition,
            MEDIA_FIELDS,
            encode_media,
            decode_media,
            self.config.op_timeout_s,
        )

    @classmethod
    async def connect(cls, config: TQSinkConfig | None = None) -> TQSink:
        """A sink in a process that has not initialised TQ yet (a Ray actor, a trainer)."""
        try:
            tq.get_client()
        except AssertionError:
            await anyio.to_thread.run_sync(tq.init)  # attaches to the running controller; blocking
        return cls(config)

    async def put(self, calls: Sequence[StagedCall]) -> None:
        """Store staged calls; an identical re-put is a no-op, a different one is refused."""
        batch: dict[StagingKey, StagedCall] = {}
        for call in calls:
            if batch.setdefault(call.key, call) != call:
                raise SinkError(
                    "conflicting_put", f"two different staged calls under {call.key} in one put"
                )
        await self._staging.put(batch, "staged call")

    async def get(self, keys: Sequence[StagingKey]) -> list[StagedCall]:
        """The staged calls for ``keys``, in order; `MissingRows` naming every absent key."""
        return await self._staging.get(keys)

    async def clear(self, keys: Sequence[StagingKey]) -> None:
        """Free staged calls (native async clear, shielded); absent keys are ignored."""
        await self._staging.clear(keys)

    async def publish(self, rows: Mapping[TrainingKey, TrainingRow]) -> None:
        """Store training rows under their keys (a key must be its row's key)."""
        for key, row in rows.items():
            if key != row.key:
                raise SinkError("key_mismatch", f"row {row.key} offered under {key}")
        await self._training.put(rows, "training row")

    async def fetch(self, keys: Sequence[TrainingKey]) -> list[TrainingRow]:
        """The training rows for ``keys``, in order; `MissingRows` naming every absent key."""
        return await self._training.get(keys)

    async def clear_rows(self, keys: Sequence[TrainingKey]) -> None:
        """Free training rows (shielded like `clear`); absent keys are ignored."""
        await self._training.clear(keys)

    async def staged_keys(self) -> list[StagingKey]:
        """Every staging key held in TQ (for leak checks and sweeps)."""
        return await self._staging.keys()

    async def row_keys(self) -> list[TrainingKey]:
        """Every training key held in TQ (for leak checks)."""
        return await self._training.keys()

    async def put_media(self, blobs: Mapping[str, bytes]) -> None:
        """Store media blobs under their digests; an identical re-put is a no-op."""
        await self._media.put({k: bytes(v) for k, v in blobs.items()}, "media blob")

    async def get_media(self, digests: Sequence[str]) -> list[bytes]:
        """The blobs of ``digests``, in order; `MissingRows` naming every absent digest."""
        return await self._media.get(digests)

    async def clear_media(self, digests: Sequence[str]) -> None:
        """Free media blobs (shielded like `clear`); absent digests are ignored."""
        await self._media.clear(digests)

    async def media_keys(self) -> list[str]:
        """Every digest held in TQ (for leak checks and sweeps)."""
        return await self._media.keys()
