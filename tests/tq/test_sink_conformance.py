"""The TokenSink contract, held against MemorySink (the reference) and TQSink (real TQ),
through the conformance kit third parties run (`tokcap_core.testing.SinkConformance`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tq.support import fresh_tq_sink, rows_of
from tokcap_core import MemorySink, TokenSink, TrainingRow
from tokcap_core.simulate import simulate_rollout
from tokcap_core.testing import SinkConformance


class TestMemorySinkConforms(SinkConformance):
    """The reference sink, through the same kit."""

    max_examples = 8

    async def make_sink(self) -> TokenSink:
        return MemorySink()


@pytest.mark.integration
@pytest.mark.slow
class TestTQSinkConforms(SinkConformance):
    """TQSink on a real TransferQueue (local Ray): a fresh pair of partitions per example."""

    max_examples = 4

    @pytest.fixture(autouse=True)
    def _cluster(self, tq_cluster: Any) -> None:
        """The session's TransferQueue must be up before any sink is made."""

    async def make_sink(self) -> TokenSink:
        sink: TokenSink = fresh_tq_sink()
        return sink


@pytest.mark.integration
def test_tq_sink_implements_the_protocol(tq_cluster: Any) -> None:
    assert isinstance(fresh_tq_sink(), TokenSink)


@pytest.mark.integration
@pytest.mark.anyio
async def test_padded_batch_widens_routes_to_int32(tq_cluster: Any) -> None:
    import torch

    from tokcap_tq import to_padded_batch

    sink = fresh_tq_sink()
    rows = [
        r
        for i in range(3)
        for r in rows_of(simulate_rollout(f"wide{i}", seed=i, turns=3, routes=True))
    ]
    await sink.publish({r.key: r for r in rows})
    fetched: list[TrainingRow] = await sink.fetch([r.key for r in rows])
    batch = to_padded_batch(fetched, pad_id=7)
    width = max(len(r.input_ids) for r in rows)
    assert batch["input_ids"].dtype == torch.int64
    assert batch["input_ids"].shape == (len(rows), width)
    assert batch["logprobs"].dtype == torch.float32
    assert batch["routes"].dtype == torch.int32
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        assert batch["input_ids"][b, :n].tolist() == list(row.input_ids)
        assert batch["input_ids"][b, n:].eq(7).all()
        assert batch["loss_mask"][b, :n].tolist() == list(row.loss_mask)
        assert row.routes is not None
        assert batch["routes"][b, :n].flatten().tolist() == list(row.routes.data)
        assert batch["routes"][b, n:].eq(-1).all()
    assert batch["sample_mask"].tolist() == [r.sample_mask for r in rows]


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_flipped_pixel_byte_in_tq_fails_the_trainers_read(tq_cluster: Any) -> None:
    from tokcap_core import VerificationError
    from tokcap_core.sink import MediaStore, fetch_media
    from tokcap_core.staged import media_blob, tensors_digest

    pixels = bytes(range(200))
    tensors = [
        ("pixel_values", "float32", (1, 50), pixels),
        ("image_sizes", "int64", (2,), bytes(16)),
    ]
    digest, blob = tensors_digest(tensors), media_blob(tensors)
    sink = fresh_tq_sink()
    assert isinstance(sink, MediaStore)
    await sink.put_media({digest: blob})
    assert tensors_digest((await fetch_media(sink, [digest]))[digest]) == digest
    await sink.clear_media([digest])
    tampered = bytearray(blob)
    tampered[blob.index(pixels) + 101] ^= 0x10
    await sink.put_media({digest: bytes(tampered)})
    with pytest.raises(VerificationError) as info:
        await fetch_media(sink, [digest])
    assert info.value.code == "media_tensors_mismatch"
    assert digest in str(info.value)
    await sink.clear_media([digest])
    assert await sink.media_keys() == []
