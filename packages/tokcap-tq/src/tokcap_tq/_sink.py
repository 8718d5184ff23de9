"""`TQSink`: the core's `TokenSink` over TransferQueue's async KV API.

TransferQueue is forgiving where a sink must not be: a get that misses keys drops them,
a get of a field some keys lack returns the shared fields only, and a put over a held key
overwrites it. This module turns each into the contract's error (`MissingRows`,
``field_mismatch``, ``conflicting_put``). Every TQ call is a native coroutine awaited on
the caller's loop; ``clear`` runs under a shield, so a cancelled clear still completes
and its rows never stay unreadable-but-unfreed. Every operation has a deadline
(``op_timeout_s``): TQ's client waits forever on a dead storage unit or controller, and a
sink must fail with a typed `SinkError` (``tq_timeout``) instead — a clear that times out
may have left its keys unfreed, so callers that track owed keys retry it. The conflict
check before a put is per process: two writers racing on one key in different processes
are not detected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import attrs

from tokcap_core import MissingRows, SinkError, StagedCall, TrainingRow
from tokcap_core.ids import StagingKey, TrainingKey

from ._codec import (
    STAGING_FIELDS,
    TRAINING_FIELDS,
    decode_rows,
    decode_staged,
    encode_rows,
    encode_staged,
)
from ._deps import tq

__all__ = ["TQSink", "TQSinkConfig"]

_T = TypeVar("_T", StagedCall, TrainingRow)
_K = TypeVar("_K", StagingKey, TrainingKey)
_NOT_FOUND = "keys or partition were not found"


def _partition_name(instance: Any, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or "/" in value:
        raise SinkError(
            "bad_config", f"{attribute.name} must be a non-empty str without '/': {value!r}"
        )


def _positive_seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SinkError("bad_config", f"{attribute.name} must be a positive number: {value!r}")
    if not math.isfinite(value):
        raise SinkError("bad_config", f"{attribute.name} must be finite: {value!r}")


@attrs.frozen(kw_only=True)
class TQSinkConfig:
    """Where a `TQSink` keeps its rows (one TQ partition for staged calls, one for training
    rows) and how long any one operation may take before it fails with ``tq_timeout``."""

    staging_partition: str = attrs.field(default="tokcap_staging", validator=_partition_name)
    training_partition: str = attrs.field(default="tokcap_training", validator=_partition_name)
    op_timeout_s: float = attrs.field(default=60.0, validator=_positive_seconds)

    def __attrs_post_init__(self) -> None:
        if self.staging_partition == self.training_partition:
            raise SinkError("bad_config", "staging and training partitions must differ")


class _Partition(Generic[_K, _T]):
    """One TQ partition holding one record type, with the sink contract's checks."""

    def __init__(
        self,
        name: str,
        fields: tuple[str, ...],
        encode: Callable[[Sequence[_T]], Any],
        decode: Callable[[Any], list[_T]],
        key_of: Callable[[_T], _K],
        timeout_s: float,
    ) -> None:
        self.name = name
        self._timeout_s = timeout_s
        self._fields = list(fields)
        self._encode: Callable[[Sequence[_T]], Any] = encode
        self._decode: Callable[[Any], list[_T]] = decode
        self._key_of: Callable[[_T], _K] = key_of

    async def put(self, batch: Mapping[_K, _T], what: str) -> None:
        if not batch:
            return
        try:
            with anyio.fail_after(self._timeout_s):
                await self._put(batch, what)
        except TimeoutError:
            raise self._timeout("put", len(batch)) from None

    async def _put(self, batch: Mapping[_K, _T], what: str) -> None:
        held = await self._held(list(batch))
        for key, record in held.items():
            if record != batch[key]:
                raise SinkError(
                    "conflicting_put", f"a different {what} is already stored under {key}"
                )
        fresh = [k for k in batch if k not in held]
        if not fresh:
            return
        fields = self._encode([batch[k] for k in fresh])
        try:
            await tq.async_kv_batch_put(keys=fresh, partition_id=self.name, fields=fields)
        except (RuntimeError, ValueError, TypeError) as e:
            # TQ registered the keys before its storage write failed: unregister them, so
            # the failed put stores nothing (they were not held before this put).
            await self.clear(fresh)
            raise SinkError(
                "tq_put_failed", f"put of {len(fresh)} keys into {self.name}: {e}"
            ) from e

    async def get(self, keys: Sequence[_K]) -> list[_T]:
        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        try:
            with anyio.fail_after(self._timeout_s):
                found = await self._fetch(unique)
        except TimeoutError:
            raise self._timeout("get", len(unique)) from None
        missing = tuple(k for k in unique if k not in found)
        if missing:
            raise MissingRows(
                "missing_rows",
                f"{len(missing)} of {len(unique)} keys are not in {self.name}",
                missing,
            )
        return [found[k] for k in keys]

    async def clear(self, keys: Sequence[_K]) -> None:
        if not keys:
            return
        unique = list(dict.fromkeys(keys))
        # No await before the shield: once clear is entered, TQ frees every key or raises.
        # The shield keeps outer cancellation out; only the sink's own deadline ends it.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self._timeout_s
            try:
                await tq.async_kv_clear(keys=unique, partition_id=self.name)
            except (RuntimeError, ValueError, TypeError) as e:
                raise SinkError(
                    "tq_clear_failed", f"clear of {len(unique)} keys in {self.name}: {e}"
                ) from e
        if scope.cancelled_caught:
            raise self._timeout("clear", len(unique))
        await anyio.lowlevel.checkpoint_if_cancelled()

    def _timeout(self, op: str, count: int) -> SinkError:
        return SinkError(
            "tq_timeout",
            f"{op} of {count} keys in {self.name} got no answer in {self._timeout_s} s",
        )

    async def keys(self) -> list[_K]:
        listing = await tq.async_kv_list(partition_id=self.name)
        return list(listing.get(self.name, {}))

    async def _held(self, keys: list[_K]) -> dict[_K, _T]:
        """The records already stored under any of ``keys`` (usually none: one controller trip)."""
        try:
            meta = await tq.get_client().async_kv_retrieve_meta(
                keys=keys, partition_id=self.name, create=False
            )
        except RuntimeError as e:
            raise SinkError("tq_get_failed", f"key lookup in {self.name}: {e}") from e
        if meta.size == 0:
            return {}
        return await self._fetch(keys)

    async def _fetch(self, keys: list[_K]) -> dict[_K, _T]:
        """The records TQ returns for ``keys``, by key; absent keys are simply not there."""
        try:
            td = await tq.async_kv_batch_get(
                keys=keys, partition_id=self.name, select_fields=self._fields
            )
        except ValueError as e:
            if _NOT_FOUND in str(e):
                return {}
            raise SinkError("field_mismatch", f"get from {self.name}: {e}") from e
        except RuntimeError as e:
            raise SinkError("tq_get_failed", f"get from {self.name}: {e}") from e
        got = sorted(td.keys())
        if got != sorted(self._fields):
            raise SinkError(
                "field_mismatch",
                f"rows in {self.name} have fields {got}, expected {sorted(self._fields)}",
            )
        records = self._decode(td)
        return {self._key_of(r): r for r in records}


class TQSink:
    """A `TokenSink` over TransferQueue (see the module docstring for the guarantees).

    TransferQueue must be initialised in this process (``local_tq``, ``tq.init()``), or use
    `TQSink.connect`, which attaches to a running TransferQueue in a worker thread.
    """

    def __init__(self, config: TQSinkConfig | None = None) -> None:
        self.config = config or TQSinkConfig()
        self._staging: _Partition[StagingKey, StagedCall] = _Partition(
            self.config.staging_partition,
            STAGING_FIELDS,
            encode_staged,
            decode_staged,
            lambda c: c.key,
            self.config.op_timeout_s,
        )
        self._training: _Partition[TrainingKey, TrainingRow] = _Partition(
            self.config.training_partition,
            TRAINING_FIELDS,
            encode_rows,
            decode_rows,
            lambda r: r.key,
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
