"""TQSink benchmarks on a local TransferQueue, as ratios within one run.

    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 uv run python bench/bench_tq.py [--repeats 3]

1. Loop stall: a 1 ms ticker runs on the event loop while keys are cleared, (a) with TQ's
   sync ``kv_clear`` called on the loop, (b) with ``TQSink.clear`` (native async clear).
   Max ticker lag, median over repeats, at 1k and 5k keys. Goal: ours <= 5 ms at 5k.
2. Throughput: ``TQSink.put``/``get`` of staged calls (encode, conflict check, decode
   included) vs raw ``async_kv_batch_put``/``async_kv_batch_get`` of the same TensorDict
   (already encoded, not decoded). Goal: <= 10 % overhead.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

os.environ.setdefault("TQ_NUM_THREADS", "2")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import anyio

from tokcap_core import StagedCall
from tokcap_tq import TQSink, TQSinkConfig, encode_staged, local_tq


def _calls(prefix: str, n: int, tokens: int, rng: random.Random) -> list[StagedCall]:
    out = []
    for i in range(n):
        gen = tokens // 2
        out.append(
            StagedCall.from_engine_output(
                rollout_id=f"{prefix}{i}",
                call_id="c000001",
                parent_id=None,
                parent_cum_len=0,
                parent_chain_hash=None,
                prompt_ids=[rng.randrange(50_000) for _ in range(tokens - gen)],
                output_ids=[rng.randrange(50_000) for _ in range(gen)],
                logprobs=[-rng.random() for _ in range(gen)],
                finish_reason="stop",
                weight_version=0,
            )
        )
    return out


async def _max_lag(work: Callable[[], Awaitable[None]]) -> float:
    lag = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal lag
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            lag = max(lag, time.perf_counter() - start - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.02)
        await work()
        done.set()
    return lag


async def _lag(sink: TQSink, n: int, repeats: int, rng: random.Random) -> tuple[float, float]:
    import transfer_queue as tq

    calls = _calls(f"lag{n}-", n, 8, rng)
    keys = [c.key for c in calls]
    sync_lags, our_lags = [], []
    for _ in range(repeats):
        await sink.put(calls)

        async def sync_clear() -> None:
            tq.kv_clear(keys=keys, partition_id=sink.config.staging_partition)

        sync_lags.append(await _max_lag(sync_clear))
        await sink.put(calls)

        async def our_clear() -> None:
            await sink.clear(keys)

        our_lags.append(await _max_lag(our_clear))
    return statistics.median(sync_lags), statistics.median(our_lags)


async def _throughput(
    sink: TQSink, batches: int, batch: int, tokens: int, rng: random.Random
) -> dict[str, float]:
    import transfer_queue as tq

    part = sink.config.staging_partition
    data = [_calls(f"tp{b}-", batch, tokens, rng) for b in range(batches)]
    raw_keys = [[f"raw/{c.key}" for c in calls] for calls in data]
    encoded = [encode_staged(calls) for calls in data]
    times: dict[str, float] = {"raw_put": 0.0, "our_put": 0.0, "raw_get": 0.0, "our_get": 0.0}
    for b, calls in enumerate(data):  # alternate raw and ours batch by batch: same load for both
        t = time.perf_counter()
        await tq.async_kv_batch_put(keys=raw_keys[b], partition_id=part, fields=encoded[b])
        times["raw_put"] += time.perf_counter() - t
        t = time.perf_counter()
        await sink.put(calls)
        times["our_put"] += time.perf_counter() - t
    for b, calls in enumerate(data):
        t = time.perf_counter()
        await tq.async_kv_batch_get(keys=raw_keys[b], partition_id=part)
        times["raw_get"] += time.perf_counter() - t
        t = time.perf_counter()
        await sink.get([c.key for c in calls])
        times["our_get"] += time.perf_counter() - t
    for b, calls in enumerate(data):
        await sink.clear(raw_keys[b] + [c.key for c in calls])
    rows = batches * batch
    return {k: rows / v for k, v in times.items()}


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    sink = TQSink(
        TQSinkConfig(staging_partition="bench_staging", training_partition="bench_training")
    )
    await sink.put(_calls("warm", 8, 16, rng))  # first op creates the partition and sockets
    print(f"{'loop stall (max lag)':<28}{'sync kv_clear':>16}{'TQSink.clear':>16}{'ratio':>10}")
    for n in (1000, 5000):
        sync, ours = await _lag(sink, n, args.repeats, rng)
        print(
            f"{f'clear {n} keys':<28}"
            f"{sync * 1e3:>13.1f} ms{ours * 1e3:>13.1f} ms{ours / sync:>10.2f}"
        )
    tp = await _throughput(sink, args.batches, args.batch, args.tokens, rng)
    print(f"\n{'throughput (rows/s)':<28}{'raw TQ':>16}{'TQSink':>16}{'overhead':>10}")
    for op in ("put", "get"):
        raw, ours = tp[f"raw_{op}"], tp[f"our_{op}"]
        print(
            f"{f'{op} {args.batch}x{args.tokens}-token rows':<28}"
            f"{raw:>16.0f}{ours:>16.0f}{raw / ours - 1:>10.1%}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tqb-") as tmp, local_tq(tmp):
        anyio.run(main, args, backend="asyncio")
