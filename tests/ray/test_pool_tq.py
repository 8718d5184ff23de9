"""The reassembler pool against TransferQueue: each actor connects its own `TQSink`."""

from __future__ import annotations

import functools

import pytest

from tests.ray.support import make_group
from tokcap_core.rows import reassemble_group
from tokcap_ray import ReassemblerPool

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.anyio,
    pytest.mark.usefixtures("ray_cluster"),
]


async def test_pool_on_tq_sink_publishes_what_in_process_reassembly_builds() -> None:
    from tests.tq.support import fresh_tq_sink
    from tokcap_tq import TQSink

    sink = fresh_tq_sink()
    kinds = ["ok", "forest", "poisoned", "missing"]
    groups = [make_group(f"tq{i}", kinds, seed=i) for i in range(8)]
    await sink.put([c for _, staged in groups for c in staged.values()])
    factory = functools.partial(TQSink.connect, sink.config)
    async with ReassemblerPool(2, factory, num_cpus=0.5) as pool:
        results = await pool.map([request for request, _ in groups])
    for (request, staged), finalized in zip(groups, results, strict=True):
        expected = reassemble_group(request, staged, staging_cleared=True)
        assert finalized.training_keys == expected.finalized.training_keys
        assert finalized.failures == expected.finalized.failures
        assert await sink.fetch(finalized.training_keys) == list(expected.rows.values())
    await sink.clear_rows([k for f in results for k in f.training_keys])
