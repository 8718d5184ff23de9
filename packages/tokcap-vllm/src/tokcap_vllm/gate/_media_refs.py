"""`MediaRefs`: the media blobs a gate staged, which held rollouts name each, and their
freeing once none does.

A blob is stored once per tensors digest however many calls name it (group siblings,
later turns), so no one rollout owns it. The gate is where every call that names a blob
passes, in one process, so it keeps the count: a call's blobs are *named* for its rollout
before they are put (a sibling's put of a held blob is a no-op), and a rollout's release
(after the trainer freed its rows: `tokcap.compose.finish`) un-names them; `free` clears
the blobs no held rollout names. Puts and frees take turns (one lock), so a blob named
again while a free is deciding is either kept or put again after it.

Limits, stated: the count lives in the gate's memory, so blobs of rollouts a gate held
when it stopped are not freed by another (the sink's ``media_keys`` lists them for a
sweep), and gates of one fleet that stage into one sink share blobs without sharing
counts: give each image-serving gate its own media partition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import anyio

from tokcap_core import TokcapError
from tokcap_core.sink import MediaStore, TokenSink

__all__ = ["MediaRefs"]


class MediaRefs:
    """Which held rollouts name each media blob the gate staged (see the module docstring)."""

    def __init__(self, sink: TokenSink) -> None:
        self.sink = sink
        self._holders: dict[str, set[str]] = {}
        self._named: dict[str, set[str]] = {}
        self._unnamed: set[str] = set()
        self._lock = anyio.Lock()

    def _store(self) -> MediaStore:
        if not isinstance(self.sink, MediaStore):
            raise TokcapError(
                "media_store_missing", f"the sink {type(self.sink).__name__} holds no images"
            )
        return self.sink

    async def put(self, named: Iterable[tuple[str, Mapping[str, bytes]]]) -> None:
        """Name each ``(rollout_id, blobs)``'s blobs for its rollout, then store them."""
        batch: dict[str, bytes] = {}
        for rollout_id, blobs in named:
            for digest in blobs:
                self._holders.setdefault(digest, set()).add(rollout_id)
                self._named.setdefault(rollout_id, set()).add(digest)
            batch.update(blobs)
        if batch:
            store = self._store()
            async with self._lock:
                await store.put_media(batch)

    def released(self, rollout_id: str) -> None:
        """``rollout_id`` names its blobs no more; those no one names wait for `free`."""
        for digest in self._named.pop(rollout_id, ()):
            holders = self._holders[digest]
            holders.discard(rollout_id)
            if not holders:
                del self._holders[digest]
                self._unnamed.add(digest)

    async def free(self) -> None:
        """Clear the blobs no held rollout names (a failed clear is retried by the next)."""
        if not self._unnamed:
            return
        store = self._store()
        async with self._lock:
            unnamed = [d for d in self._unnamed if d not in self._holders]
            self._unnamed.clear()
            try:
                await store.clear_media(unnamed)
            except BaseException:
                self._unnamed.update(d for d in unnamed if d not in self._holders)
                raise

    def named(self) -> dict[str, frozenset[str]]:
        """Each held digest and the rollouts naming it (for tests and health)."""
        return {digest: frozenset(ids) for digest, ids in self._holders.items()}
