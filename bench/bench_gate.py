"""Plain vLLM serving vs serving through the tokcap gate with capture: same engine, same run.

One in-process vLLM CPU server (tiny model, fast-start mode) with the gate installed. Plain
requests go to ``/v1/chat/completions`` (the middleware only routes them); captured requests
go to ``/tokcap/rollouts/{id}/v1/chat/completions`` (admission, token_in, staging into a
MemorySink, ledger commit). Rounds alternate plain/captured so drift hits both alike.

    .venv/bin/python bench/bench_gate.py [--requests 128] [--concurrency 32] [--max-tokens 32] [--rounds 3]
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


async def _round(
    base: str,
    model: str,
    *,
    captured: bool,
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
            if captured
            else f"{base}/v1/chat/completions"
        )
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"request {i}: write some code"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with limiter:
            start = time.perf_counter()
            r = await http.post(url, json=body)
            latencies.append(time.perf_counter() - start)
        r.raise_for_status()
        tokens += r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    async with httpx.AsyncClient(
        timeout=300, limits=httpx.Limits(max_connections=concurrency)
    ) as http, anyio.create_task_group() as tg:
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
    args = parser.parse_args()
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
        anyio.run(
            lambda: _round(server.base_url, model, captured=False, tag="warm", **kw)
        )  # warm-up
        totals = {False: [0.0, [], 0], True: [0.0, [], 0]}
        for r in range(args.rounds):
            for captured in (False, True) if r % 2 == 0 else (True, False):
                wall, lats, toks = anyio.run(
                    lambda c=captured, r=r: _round(
                        server.base_url, model, captured=c, tag=f"b{r}", **kw
                    )
                )
                totals[captured][0] += wall
                totals[captured][1] += lats
                totals[captured][2] += toks
                print(
                    f"round {r} {'captured' if captured else 'plain   '}: {toks / wall:8.1f} tok/s",
                    flush=True,
                )
        server.call(server.gate.drain)
        staged = server.gate.metrics().get("tokcap/calls_staged", 0.0)
        rows = {}
        for captured, (wall, lats, toks) in totals.items():
            rows[captured] = (toks / wall, _pct(lats, 0.5) * 1e3, _pct(lats, 0.99) * 1e3)
        print(f"\n{'':10}{'tok/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
        for captured, (tps, p50, p99) in rows.items():
            print(f"{'captured' if captured else 'plain':10}{tps:10.1f}{p50:10.1f}{p99:10.1f}")
        overhead = 1 - rows[True][0] / rows[False][0]
        print(
            f"\nthroughput overhead of capture: {overhead * 100:+.2f} % (goal <= 2 %); "
            f"p50 ratio {rows[True][1] / rows[False][1]:.3f}, p99 ratio {rows[True][2] / rows[False][2]:.3f}; "
            f"calls staged {int(staged)}"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
