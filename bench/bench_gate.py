"""Plain vLLM serving vs serving through the tokcap gate with capture: same engine, same run.

For each model size (``--models``: the demo's tiny model and/or a ~100M-parameter random
Qwen3 of the same family, `tokcap.tiny.build_small_model`), one in-process vLLM CPU server (fp32,
fast-start mode) with the gate installed, in a child process of its own (one engine at a
time). Four kinds of requests, each ``--requests`` chat calls at ``--concurrency``:

- ``plain``: ``/v1/chat/completions`` (the middleware only routes it);
- ``plain+logprobs``: the same asking for the sampled token's logprob (``logprobs: true,
  top_logprobs: 0``): capture needs that logprob, so this is what vLLM itself charges for
  it, apart from the gate;
- ``captured``: ``/tokcap/rollouts/{id}/v1/chat/completions`` (admission, token_in,
  staging into a MemorySink, ledger commit), vLLM skipping the text of the logprobs only
  the gate reads (`tokcap_vllm.gate._logprob_text`);
- ``captured+text``: the same with that switch off for the round (vLLM decodes every
  logprob token to text, as before the switch): what the switch saves.

Every kind is warmed up (vLLM compiles its logprob-rank kernel on the first request that
asks for logprobs) and the order of kinds rotates between rounds so drift hits all alike.
Overheads are ratios of tokens per second summed over all rounds; the spread is the
lowest and highest of the per-round ratios (round r's kinds ran back to back).

The engine core runs with ``--engine-threads`` OpenMP threads (default: all cores but one).
On a small CPU box an engine using every core shares them with the API server process (HTTP,
detokenising, the gate); each of the engine's OpenMP regions then waits for a descheduled
thread, which turns a few microseconds of sampler work into milliseconds per step.

    .venv/bin/python bench/bench_gate.py [--models tiny,small] [--requests 128]
        [--concurrency 32] [--max-tokens 32] [--rounds 4] [--engine-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import CPU_ENGINE_ARGS, set_engine_env  # bench/ is on sys.path

set_engine_env()

from _procmem import cpu_seconds, descendants, role_of  # noqa: E402  (bench/ is on sys.path)

KINDS = ("plain", "plain+logprobs", "captured", "captured+text")
ROOT = Path(__file__).resolve().parents[1]


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
            if kind.startswith("captured")
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
        httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http,
        anyio.create_task_group() as tg,
    ):
        for i in range(requests):
            tg.start_soon(one, http, i)
    return time.perf_counter() - start, latencies, tokens


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def _model_dir(size: str) -> Path:
    sys.path.insert(0, str(ROOT / "src"))
    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    if size == "tiny":
        from tokcap.tiny import build_tiny_model

        return build_tiny_model(cache / "dense")
    from tokcap.tiny import build_small_model

    return build_small_model(cache / "small")


def _measure(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine of ``size``: warm-up, then ``rounds`` rounds of every kind, rotating."""
    import anyio

    from tokcap.tiny import parameter_count
    from tokcap_vllm import InProcessServer

    model = str(_model_dir(size))
    print(f"[{size}] starting vLLM + gate ...", flush=True)
    options = ("--max-model-len", "2048", "--disable-log-stats", "--max-num-seqs", "64")
    server = InProcessServer(model, vllm_args=[*CPU_ENGINE_ARGS, *options]).start()
    try:
        kw: dict[str, Any] = dict(
            requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens
        )

        engines = [pid for pid in descendants() if role_of(pid) == "engine core"]

        def run(kind: str, tag: str) -> dict[str, Any]:
            host = getattr(server.engine_client, "_tokcap_host", None)
            if host is not None:  # installed by the first captured request
                host.skips_logprob_text = kind != "captured+text"
            server_cpu = cpu_seconds()
            engine_cpu = sum(cpu_seconds(pid) for pid in engines)
            wall, latencies, tokens = anyio.run(
                lambda: _round(server.base_url, model, kind=kind, tag=tag, **kw)
            )
            return {
                "wall": wall,
                "latencies": latencies,
                "tokens": tokens,
                "server_cpu": cpu_seconds() - server_cpu,
                "engine_cpu": sum(cpu_seconds(pid) for pid in engines) - engine_cpu,
            }

        run("captured", "warm-c")
        if not server.engine_client._tokcap_host.skips_logprob_text:
            raise RuntimeError("the logprob-text switch is off on this vLLM")
        for kind in KINDS:  # warm-up, not measured
            run(kind, f"warm-{kind[0]}{len(kind)}")
        per_round: list[dict[str, dict[str, Any]]] = []
        loads = [_load()]
        for r in range(args.rounds):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            results = {}
            for kind in order:
                results[kind] = got = run(kind, f"b{r}-{kind[0]}{len(kind)}")
                print(
                    f"[{size}] round {r} {kind:15}: {got['tokens'] / got['wall']:8.1f} tok/s, "
                    f"CPU ms/call server {got['server_cpu'] / args.requests * 1e3:.1f} "
                    f"engine {got['engine_cpu'] / args.requests * 1e3:.1f}",
                    flush=True,
                )
            per_round.append(results)
            loads.append(_load())
        server.call(server.gate.drain)
        staged = server.gate.metrics().get("tokcap/calls_staged", 0.0)
        return {
            "size": size,
            "params": parameter_count(Path(model)),
            "rounds": per_round,
            "calls_staged": int(staged),
            "loads": loads,
        }
    finally:
        server.stop()


def _summary(result: dict[str, Any], args: argparse.Namespace) -> str:
    rounds = result["rounds"]

    def total(rnds: list[dict[str, Any]], kind: str, what: str) -> float:
        return float(sum(r[kind][what] for r in rnds))

    def tps(rnds: list[dict[str, Any]], kind: str) -> float:
        return total(rnds, kind, "tokens") / total(rnds, kind, "wall")

    def cpu(rnds: list[dict[str, Any]], kind: str) -> float:
        """Server + engine CPU seconds per token."""
        spent = total(rnds, kind, "server_cpu") + total(rnds, kind, "engine_cpu")
        return spent / total(rnds, kind, "tokens")

    def overhead(base: str, kind: str) -> tuple[float, float, float, float]:
        pooled = (1 - tps(rounds, kind) / tps(rounds, base)) * 100
        each = [(1 - tps([r], kind) / tps([r], base)) * 100 for r in rounds]
        cpu_more = (cpu(rounds, kind) / cpu(rounds, base) - 1) * 100
        return pooled, min(each), max(each), cpu_more

    calls = args.requests * len(rounds)
    lines = [
        f"\n### {result['size']} ({result['params'] / 1e6:.1f} M parameters): "
        f"{args.requests} requests x {args.rounds} rounds per kind, concurrency "
        f"{args.concurrency}, {args.max_tokens} tokens each, engine threads "
        f"{args.engine_threads}; 1-min load at each round's end: {' '.join(result['loads'])}",
        "",
        "| kind | tok/s | p50 ms | p99 ms | server CPU ms/call | engine CPU ms/call |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        lats = [x for r in rounds for x in r[kind]["latencies"]]
        lines.append(
            f"| {kind} | {tps(rounds, kind):.1f} | {_pct(lats, 0.5) * 1e3:.0f} "
            f"| {_pct(lats, 0.99) * 1e3:.0f} "
            f"| {total(rounds, kind, 'server_cpu') / calls * 1e3:.2f} "
            f"| {total(rounds, kind, 'engine_cpu') / calls * 1e3:.2f} |"
        )
    lines += [
        "",
        "| overhead | throughput, pooled | per-round min .. max | CPU per token |",
        "|---|---:|---|---:|",
    ]
    for label, base, kind in (
        ("**capture, total** (captured vs plain)", "plain", "captured"),
        ("vLLM's sampled-token logprob (plain+logprobs vs plain)", "plain", "plain+logprobs"),
        ("**the gate's own** (captured vs plain+logprobs)", "plain+logprobs", "captured"),
        ("capture before the switch (captured+text vs plain)", "plain", "captured+text"),
        (
            "the logprob text the switch skips (captured+text vs captured)",
            "captured",
            "captured+text",
        ),
    ):
        pooled, low, high, cpu_more = overhead(base, kind)
        lines.append(
            f"| {label} | {pooled:+.2f} % | {low:+.2f} .. {high:+.2f} % | {cpu_more:+.2f} % |"
        )
    lines.append(
        f"\ncalls staged: {result['calls_staged']}. Server CPU: the API server process "
        "(HTTP, vLLM's serving, the gate) and the benchmark's client; engine CPU: vLLM's "
        "engine core process."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small", help="comma-separated: tiny, small")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--engine-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [s for s in args.models.split(",") if s]
    if any(s not in ("tiny", "small") for s in sizes):
        parser.error("--models takes tiny and/or small")
    if args.child_out:  # one size, in this process; the parent reads the JSON
        os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)  # read at the engine's spawn
        (size,) = sizes
        Path(args.child_out).write_text(json.dumps(_measure(size, args)))
        return
    import tempfile

    results = []
    started_load = _load()
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as tmp:
        for size in sizes:
            _model_dir(size)  # build (or reuse) before the engine starts
            out = Path(tmp) / f"{size}.json"
            child = [sys.executable, __file__, "--models", size, "--child-out", str(out)]
            for flag in ("requests", "concurrency", "max_tokens", "rounds", "engine_threads"):
                child += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            subprocess.run(child, check=True)
            results.append(json.loads(out.read_text()))
    print(f"\n## bench_gate (1-min load at start {started_load})")
    for result in results:
        print(_summary(result, args))


if __name__ == "__main__":
    main()
