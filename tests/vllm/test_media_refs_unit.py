"""The gate's count of which held rollouts name each staged media blob (`_media_refs`):
a blob stays while any rollout names it and is freed with the last release."""

from __future__ import annotations

import anyio
import pytest

from tokcap_core import MemorySink, TokcapError
from tokcap_core.staged import media_blob, tensors_digest
from tokcap_vllm.gate._media_refs import MediaRefs


def blob(seed: int) -> tuple[str, bytes]:
    tensors = [("pixel_values", "uint8", (4,), bytes([seed] * 4))]
    return tensors_digest(tensors), media_blob(tensors)


def test_a_blob_is_freed_when_the_last_rollout_naming_it_is_released() -> None:
    (a, blob_a), (b, blob_b) = blob(1), blob(2)

    async def main() -> None:
        sink = MemorySink()
        refs = MediaRefs(sink)
        await refs.put([("r1", {a: blob_a}), ("r2", {a: blob_a, b: blob_b})])
        await refs.put([("r2", {a: blob_a})])  # a later turn's re-put: a no-op
        assert sorted(await sink.media_keys()) == sorted([a, b])
        refs.released("r2")
        await refs.free()
        assert await sink.media_keys() == [a]  # r1 still names a
        assert refs.named() == {a: frozenset({"r1"})}
        refs.released("r1")
        refs.released("r1")  # a second release changes nothing
        await refs.free()
        assert await sink.media_keys() == []

    anyio.run(main)


def test_a_blob_named_again_before_the_free_is_kept() -> None:
    digest, data = blob(3)

    async def main() -> None:
        sink = MemorySink()
        refs = MediaRefs(sink)
        await refs.put([("r1", {digest: data})])
        refs.released("r1")
        await refs.put([("r2", {digest: data})])  # a sibling of the next step
        await refs.free()
        assert await sink.media_keys() == [digest]

    anyio.run(main)


def test_a_sink_without_a_media_store_is_refused_typed() -> None:
    class TextOnly:
        pass

    digest, data = blob(4)
    refs = MediaRefs(TextOnly())  # type: ignore[arg-type]
    with pytest.raises(TokcapError) as info:
        anyio.run(refs.put, [("r1", {digest: data})])
    assert info.value.code == "media_store_missing"
