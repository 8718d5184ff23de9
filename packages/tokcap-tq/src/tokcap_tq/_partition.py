"""One TransferQueue partition holding one record type, with the sink contract's checks.

What TransferQueue 0.1.11 does per call, and what a partition adds to it:

- ``async_kv_batch_put`` is three controller round trips and one to the storage units:
  register the keys (``kv_retrieve_meta(create=True)``), write the data, mark it produced,
  and store one tag dict per key (``set_custom_meta``). A put here makes those very calls
  itself, and tags every key it writes ``{"tokcap": 1}``. The registration's answer carries
  each key's tag, so a key that is already held shows up in the put's own first round
  trip: nothing is looked up beforehand. Only held keys are read back and compared (a
  retry: identical is a no-op, different is ``conflicting_put``, and the keys this put
  registered are unregistered again, so a refused batch stores nothing).
- ``async_kv_batch_get`` is a lookup (``kv_retrieve_meta(create=False)``, which drops
  unknown keys without a word) and a read. A get here makes the same two calls; only when
  the lookup comes back short or not ready does it list the partition to name exactly
  the keys that are missing (`MissingRows`), and a key that is registered but not yet
  written (a put in flight) counts as missing, not as a field mismatch.
- Within one process, puts of overlapping keys take turns (an in-process claim per key),
  so two racing writers of one key see each other: the second is a no-op or a
  ``conflicting_put``. Writers in different processes racing on one key are not detected.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from tokcap_core import MissingRows, SinkError, StagedCall, TrainingRow
from tokcap_core.ids import StagingKey, TrainingKey

from ._deps import tq

__all__ = ["STORED_TAG", "Partition"]

_T = TypeVar("_T", StagedCall, TrainingRow, bytes)
_K = TypeVar("_K", StagingKey, TrainingKey, str)

STORED_TAG = "tokcap"
"""The per-key TQ tag a completed put leaves: its presence means the key is held."""
_TAGS = {STORED_TAG: 1}
_ERRORS = (RuntimeError, ValueError, TypeError)


class Partition(Generic[_K, _T]):
    """One TQ partition holding one record type (see the module docstring)."""

    def __init__(
        self,
        name: str,
        fields: tuple[str, ...],
        encode: Callable[[Sequence[_T]], Any],
        decode: Callable[[Any], list[_T]],
        timeout_s: float,
    ) -> None:
        self.name = name
        self._timeout_s = timeout_s
        self._fields = list(fields)
        self._field_set = frozenset(fields)
        self._encode: Callable[[Sequence[_T]], Any] = encode
        self._decode: Callable[[Any], list[_T]] = decode
        self._writing: dict[str, anyio.Event] = {}

    # ---- the contract's operations, each under the sink's deadline ----------------------

    async def put(self, batch: Mapping[_K, _T], what: str) -> None:
        """Store ``batch``; held identical records are kept, a different one is refused."""
        if not batch:
            return
        try:
            with anyio.fail_after(self._timeout_s):
                async with self._claim(list(batch)):
                    await self._put(batch, what)
        except TimeoutError:
            raise self._timeout("put", len(batch)) from None

    async def get(self, keys: Sequence[_K]) -> list[_T]:
        """The records of ``keys`` in order, or `MissingRows` naming every absent key."""
        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        try:
            with anyio.fail_after(self._timeout_s):
                found = await self._read(unique)
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
        """Free ``keys`` (absent ones are ignored), shielded up to the sink's deadline."""
        if not keys:
            return
        unique = list(dict.fromkeys(keys))
        # No await before the shield: once clear is entered, TQ frees every key or raises.
        # The shield keeps outer cancellation out; only the sink's own deadline ends it.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self._timeout_s
            try:
                await tq.async_kv_clear(keys=unique, partition_id=self.name)
            except _ERRORS as e:
                raise SinkError(
                    "tq_clear_failed", f"clear of {len(unique)} keys in {self.name}: {e}"
                ) from e
        if scope.cancelled_caught:
            raise self._timeout("clear", len(unique))
        await anyio.lowlevel.checkpoint_if_cancelled()

    async def keys(self) -> list[_K]:
        """Every key registered in the partition (held, or being written)."""
        try:
            with anyio.fail_after(self._timeout_s):
                listing = await self._list()
        except TimeoutError:
            raise self._timeout("list", 0) from None
        return list(listing)

    # ---- put ----------------------------------------------------------------------------

    async def _put(self, batch: Mapping[_K, _T], what: str) -> None:
        keys = list(batch)
        meta = await self._lookup(keys, create=True, op="put")
        if meta.size != len(keys):
            raise SinkError(
                "tq_put_failed", f"{self.name} registered {meta.size} of {len(keys)} keys"
            )
        held = [k for k, tags in zip(keys, meta.custom_meta, strict=True) if STORED_TAG in tags]
        stored: dict[_K, _T] = await self._read(held) if held else {}
        fresh = [i for i, k in enumerate(keys) if k not in stored]
        conflicts = [k for k, record in stored.items() if record != batch[k]]
        if conflicts:
            await self._unregister([keys[i] for i in fresh])
            raise SinkError(
                "conflicting_put", f"a different {what} is already stored under {conflicts[0]}"
            )
        if not fresh:
            return
        target = meta if len(fresh) == len(keys) else meta.select_samples(fresh)
        target.update_custom_meta([_TAGS] * target.size)
        try:
            fields = self._encode([batch[keys[i]] for i in fresh])
            await tq.get_client().async_put(fields, target)
        except _ERRORS as e:
            # The keys were registered before the write failed: unregister them, so the
            # failed put stores nothing (none of them was held before this put).
            await self._unregister([keys[i] for i in fresh])
            raise SinkError(
                "tq_put_failed", f"put of {len(fresh)} keys into {self.name}: {e}"
            ) from e

    @asynccontextmanager
    async def _claim(self, keys: list[_K]) -> AsyncIterator[None]:
        """Wait until no other put in this process is writing any of ``keys``, then hold them."""
        while busy := [self._writing[k] for k in keys if k in self._writing]:
            await busy[0].wait()
        done = anyio.Event()
        for key in keys:
            self._writing[key] = done
        try:
            yield
        finally:
            for key in keys:
                del self._writing[key]
            done.set()

    async def _unregister(self, keys: list[_K]) -> None:
        if keys:
            await self.clear(keys)

    # ---- get ----------------------------------------------------------------------------

    async def _read(self, keys: list[_K]) -> dict[_K, _T]:
        """The records held under ``keys``, by key; absent or unwritten keys are left out."""
        meta = await self._lookup(keys, create=False, op="get")
        if meta.size == len(keys) and self._readable(meta):
            return await self._fetch(meta, keys)
        return await self._read_present(keys)

    async def _read_present(self, keys: list[_K]) -> dict[_K, _T]:
        """The slow path of `_read`: some keys are absent or not written yet."""
        listing = await self._list()
        stored = [k for k in keys if STORED_TAG in listing.get(k, {})]
        if not stored:
            return {}
        meta = await self._lookup(stored, create=False, op="get")
        if meta.size == len(stored) and self._readable(meta):
            return await self._fetch(meta, stored)
        # A key went away (or is going) between the listing and the lookup: ask one by one.
        found: dict[_K, _T] = {}
        for key in stored:
            one = await self._lookup([key], create=False, op="get")
            if one.size == 1 and self._readable(one):
                found.update(await self._fetch(one, [key]))
        return found

    def _readable(self, meta: Any) -> bool:
        """Every looked-up key is written; `SinkError` if they carry other fields than ours."""
        if not meta.is_ready:
            return False
        if not self._field_set <= set(meta.field_names):
            raise SinkError(
                "field_mismatch",
                f"rows in {self.name} have fields {meta.field_names}, expected {self._fields}",
            )
        return True

    async def _fetch(self, meta: Any, keys: list[_K]) -> dict[_K, _T]:
        """Read the rows ``meta`` (a lookup of ``keys``, in order) points at, by key."""
        if meta.field_names != sorted(self._fields):
            meta = meta.select_fields(self._fields)
        try:
            td = await tq.get_client().async_get_data(meta)
        except _ERRORS as e:
            raise SinkError("tq_get_failed", f"get from {self.name}: {e}") from e
        records = self._decode(td)
        # TQ answers in the lookup's order, which is the order of ``keys``.
        if len(records) != len(keys):
            raise SinkError(
                "bad_layout", f"{self.name} returned {len(records)} of {len(keys)} rows"
            )
        return dict(zip(keys, records, strict=True))

    # ---- controller calls -----------------------------------------------------------------

    async def _lookup(self, keys: list[_K], *, create: bool, op: str) -> Any:
        try:
            return await tq.get_client().async_kv_retrieve_meta(
                keys=keys, partition_id=self.name, create=create
            )
        except _ERRORS as e:
            raise SinkError(f"tq_{op}_failed", f"key lookup in {self.name}: {e}") from e

    async def _list(self) -> dict[Any, dict[str, Any]]:
        try:
            listing = await tq.async_kv_list(partition_id=self.name)
        except _ERRORS as e:
            raise SinkError("tq_list_failed", f"listing {self.name}: {e}") from e
        held: dict[Any, dict[str, Any]] = listing.get(self.name, {})
        return held

    def _timeout(self, op: str, count: int) -> SinkError:
        what = f"{op} of {count} keys in {self.name}" if count else f"{op} of {self.name}"
        return SinkError("tq_timeout", f"{what} got no answer in {self._timeout_s} s")
