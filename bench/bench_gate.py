"""Plain vLLM serving vs serving through the tokcap gate with capture: same engine, same run.

One in-process vLLM CPU server (tiny model, fast-start mode) with the gate installed. Plain
requests go to ``/v1/chat/completions`` (the middleware only routes them); captured requests
go to ``/tokcap/rollouts/{id}/v1/chat/completions`` (admission, token_in, staging into a
MemorySink, ledger commit). A third kind, plain requests asking for the sampled token's
logprob (``logprobs: true, top_logprobs: 0``), is a reference: capture needs that logprob, so
it shows what vLLM itself charges for it, apart from the gate. Every kind is warmed up (vLLM
compiles its logprob-rank kernel on the first request that asks for logprobs) and the order
of kinds rotates between rounds so drift hits all alike.

The engine core runs with ``--engine-threads`` OpenMP threads (default: all cores but one).
On a small CPU box an engine using every core shares them with the API server process (HTTP,
detokenising, the gate); each of the engine's OpenMP regions then waits for a descheduled
thread, which turns a few microseconds of sampler work into milliseconds per step.

    .venv/bin/python bench/bench_gate.py [--requests 128] [--concurrency 32] [--max-tokens 32]
        [--rounds 3] [--engine-threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_k, _v)


KINDS = ("plain", "plain+logprobs", "captured")


async def _round(
    base: str,
    model: str,
    *,
    kind: str,
    tag: str,
    requests: int,
    concurrency: int,
    max_tokens: int,
) -> tuple[float, list[float], int]:
    import anyio
    import httpx

    latencies: list[float] = []
    tokens = 0
    limiter = anyio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        url = (
            f"{base}/tokcap/rollouts/{tag}-{i}/v1/chat/completions"
            if kind == "captured"
            else f"{base}/v1/chat/completions"
        )
        body: dict[str, object] = {
            "model": model,
            "messages": [{"role": "user", "content": f"request {i}: write some code"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if kind == "plain+logprobs":
            body.update(logprobs=True, top_logprobs=0)
        async with limiter:
            start = time.perf_counter()
            r = await http.post(url, json=body)
            latencies.append(time.perf_counter() - start)
        r.raise_for_status()
        usage = r.json()["usage"]
        if usage["completion_tokens"] != max_tokens:  # every kind generates the same tokens
            raise RuntimeError(f"{kind}: {usage['completion_tokens']} tokens, not {max_tokens}")
        tokens += usage["completion_tokens"]

    start = time.perf_counter()
    async with (
        httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as http,
        anyio.create_task_group() as tg,
    ):
        for i in range(requests):
            tg.start_soon(one, http, i)
    return time.perf_counter() - start, latencies, tokens


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)  # the engine core reads it at spawn
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import anyio

    from tokcap._tiny import build_tiny_model
    from tokcap_vllm import InProcessServer

    model = str(
        build_tiny_model(Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense")
    )
    print("starting vLLM + gate ...", flush=True)
    server = InProcessServer(
        model,
        vllm_args=[
            "--enforce-eager",
            "--distributed-executor-backend",
            "uni",
            "--max-model-len",
            "2048",
            "--dtype",
            "float32",
            "--disable-log-stats",
            "--max-num-seqs",
            "64",
        ],
    ).start()
    try:
        kw = dict(requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens)
        for kind in KINDS:  # warm-up, not measured
            anyio.run(lambda k=kind: _round(server.base_url, model, kind=k, tag="warm", **kw))
        totals: dict[str, tuple[float, list[float], int]] = {k: (0.0, [], 0) for k in KINDS}
        for r in range(args.rounds):
            for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
                wall, lats, toks = anyio.run(
                    lambda k=kind, r=r: _round(server.base_url, model, kind=k, tag=f"b{r}", **kw)
                )
                w, ls, t = totals[kind]
                totals[kind] = (w + wall, ls + lats, t + toks)
                print(f"round {r} {kind:15}: {toks / wall:8.1f} tok/s", flush=True)
        server.call(server.gate.drain)
        staged = server.gate.metrics().get("tokcap/calls_staged", 0.0)
        rows = {
            kind: (toks / wall, _pct(lats, 0.5) * 1e3, _pct(lats, 0.99) * 1e3)
            for kind, (wall, lats, toks) in totals.items()
        }
        print(
            f"\nconcurrency {args.concurrency}, {args.requests} requests x {args.rounds} rounds, "
            f"{args.max_tokens} tokens each, engine threads {args.engine_threads}"
        )
        print(f"{'':16}{'tok/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
        for kind, (tps, p50, p99) in rows.items():
            print(f"{kind:16}{tps:10.1f}{p50:10.1f}{p99:10.1f}")
        plain, logprobs, captured = rows["plain"], rows["plain+logprobs"], rows["captured"]
        print(
            f"\nthroughput overhead of capture: {(1 - captured[0] / plain[0]) * 100:+.2f} % "
            f"(goal <= 2 %); p50 ratio {captured[1] / plain[1]:.3f}, "
            f"p99 ratio {captured[2] / plain[2]:.3f}; calls staged {int(staged)}\n"
            f"  of which vLLM's sampled-token logprob: "
            f"{(1 - logprobs[0] / plain[0]) * 100:+.2f} %; "
            f"the gate beyond it: {(1 - captured[0] / logprobs[0]) * 100:+.2f} %"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
