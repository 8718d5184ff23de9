"""Load: many concurrent multi-turn rollouts through one gate, with a plain round to compare.

One in-process vLLM CPU server (tiny model, fast-start settings as in tests/vllm) with the
gate installed over a `MemorySink`, ledger persisted to a file, control token set. Two rounds
of the *same* conversations at the *same* concurrency (every rollout runs its turns in
sequence, all rollouts at once), through one `openai.AsyncOpenAI` connection pool:

- **plain**: ``/v1/chat/completions`` (the middleware routes it to vLLM untouched);
- **captured**: ``/tokcap/rollouts/{id}/v1/chat/completions`` (admission, token_in,
  staging, ledger commit).

Then every captured rollout is closed and its receipt fetched over the control plane
(`ControlPlaneClient.fetch_receipts`, heads kept at close), and the harness's view is
checked against custody: every call the harness got a response for is ``Staged`` in the
ledger under the response id it saw, its row is in the sink, receipts verify and name
every call of the rollout's chain, no staging key is duplicated or extra. The rollouts are
then released and their keys cleared, and the sink must be empty.

Memory: VmRSS sampled every 0.25 s per phase, plus ``ru_maxrss`` (peak of the process).
The harness shares the process (and the GIL) with the server, so latencies are end to end
on a loaded box; *added* latency is captured minus plain of the same percentile.

    .venv/bin/python bench/load_gate.py [--rollouts 500] [--turns 4] [--max-tokens 8]
        [--max-num-seqs 256] [--captured-first]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_k, _v)

TOKEN = "load-bench-" + os.urandom(8).hex()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _round(
    server: Any, http: Any, *, captured: bool, tag: str, rollouts: int, turns: int, max_tokens: int
) -> dict[str, Any]:
    """All rollouts at once, each running ``turns`` calls in sequence; latencies per call."""
    import anyio
    import openai

    latencies: list[float] = []
    responses: dict[str, list[str]] = {}
    errors: list[str] = []
    rss_peak = _rss_mib()
    done = anyio.Event()

    async def sample() -> None:
        nonlocal rss_peak
        while not done.is_set():
            rss_peak = max(rss_peak, _rss_mib())
            await anyio.sleep(0.25)

    async def rollout(i: int) -> None:
        rid = f"load-{tag}-{i:04d}"
        base = server.rollout_url(rid) if captured else f"{server.base_url}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, http_client=http)
        messages: list[Any] = [{"role": "user", "content": f"conversation {i}: say something"}]
        seen = responses.setdefault(rid, [])
        for turn in range(turns):
            start = time.perf_counter()
            try:
                r = await client.chat.completions.create(
                    model=server.model, messages=messages, max_tokens=max_tokens, temperature=0.0
                )
            except Exception as e:  # counted and shown; a lost call is any of these
                errors.append(f"{rid}/{turn}: {type(e).__name__}: {e}"[:200])
                return
            latencies.append(time.perf_counter() - start)
            seen.append(r.id)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"turn {turn} of {i}"},
            ]

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        async with anyio.create_task_group() as calls:
            for i in range(rollouts):
                calls.start_soon(rollout, i)
        done.set()
    wall = time.perf_counter() - start
    return {
        "latencies": latencies,
        "responses": responses,
        "errors": errors,
        "wall": wall,
        "rss_peak": rss_peak,
    }


async def _custody(server: Any, responses: dict[str, list[str]], turns: int) -> dict[str, Any]:
    """Close, fetch receipts, compare with what the harness saw; release and clear."""
    import anyio

    from tokcap_core.ledger import Staged
    from tokcap_vllm import ControlPlaneClient

    gate = server.gate

    async def on_server(fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: server.call(fn, *args, timeout=600))

    await on_server(gate.drain)
    heads: dict[str, tuple[int, str]] = {}
    async with ControlPlaneClient(server.base_url, TOKEN, max_concurrency=32) as cp:
        limiter = anyio.Semaphore(32)

        async def close(rid: str) -> None:
            async with limiter:
                heads[rid] = await cp.close(rid, reward=1.0)

        async with anyio.create_task_group() as tg:
            for rid in responses:
                tg.start_soon(close, rid)
        receipts = await cp.fetch_receipts(list(responses), expected_heads=heads)

        async def ledgers() -> dict[str, list[Any]]:
            return {rid: [e.event for e in gate.ledger(rid).entries] for rid in responses}

        events = await on_server(ledgers)
        keys_in_receipts: list[str] = []
        lost, not_staged, bad_receipts, short_chains = 0, 0, 0, 0
        for receipt in receipts:
            rid = receipt.rollout_id
            staged_ids = {e.response_id for e in events[rid] if isinstance(e, Staged)}
            not_staged += sum(1 for r in responses[rid] if r not in staged_ids)
            if not receipt.ok:
                bad_receipts += 1
                continue
            chain = [c.staging_key for c in receipt.segments[0]]
            short_chains += len(chain) != len(responses[rid])
            keys_in_receipts += chain

        async def fetch(keys: list[str]) -> Any:
            return await gate.sink.get(keys)

        rows = await on_server(fetch, keys_in_receipts)
        lost = len(keys_in_receipts) - len(rows)
        held = await on_server(_staged_keys, gate)
        duplicate_keys = len(keys_in_receipts) - len(set(keys_in_receipts))
        extra_keys = len(set(held) - set(keys_in_receipts))

        async def release(rid: str) -> None:
            async with limiter:
                await cp.release(rid)

        async with anyio.create_task_group() as tg:
            for rid in responses:
                tg.start_soon(release, rid)
    await on_server(gate.sink.clear, keys_in_receipts)
    leaked = len(await on_server(_staged_keys, gate))
    return {
        "receipts_verified": sum(1 for r in receipts if r.ok),
        "receipts": len(receipts),
        "calls_not_staged": not_staged,
        "bad_receipts": bad_receipts,
        "chains_not_matching_calls": short_chains,
        "rows_in_sink": len(rows),
        "rows_lost": lost,
        "duplicate_keys": duplicate_keys,
        "extra_keys": extra_keys,
        "keys_leaked_after_clear": leaked,
        "gate_rollouts_after_release": len(await on_server(_rollouts, gate)),
    }


async def _staged_keys(gate: Any) -> list[str]:
    return list(await gate.sink.staged_keys())


async def _rollouts(gate: Any) -> dict[str, str]:
    return gate.rollouts()


async def _main(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(
        max_connections=args.rollouts + 100, max_keepalive_connections=args.rollouts + 100
    )
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0)) as http:
        common = {"turns": args.turns, "max_tokens": args.max_tokens}
        warm = await _round(server, http, captured=True, tag="warm", rollouts=8, **common)
        await _round(server, http, captured=False, tag="warm", rollouts=8, **common)
        await _custody(server, warm["responses"], args.turns)
        rss_idle = _rss_mib()
        rounds, rss = {}, {}
        for kind in ("captured", "plain") if args.captured_first else ("plain", "captured"):
            rounds[kind] = await _round(
                server,
                http,
                captured=kind == "captured",
                tag=kind[0],
                rollouts=args.rollouts,
                **common,
            )
            rss[kind] = _rss_mib()
        plain, captured = rounds["plain"], rounds["captured"]
        rss_after_plain, rss_after_captured = rss["plain"], rss["captured"]
    custody = await _custody(server, captured["responses"], args.turns)
    return {
        "plain": plain,
        "captured": captured,
        "custody": custody,
        "rss_idle": rss_idle,
        "rss_after_plain": rss_after_plain,
        "rss_after_captured": rss_after_captured,
        "rss_after_release": _rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=500)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--captured-first", action="store_true", help="run the captured round before the plain one"
    )
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import anyio

    from tests.vllm._helpers import VLLM_ARGS
    from tokcap._tiny import build_tiny_model
    from tokcap_core import CaptureConfig, MemorySink
    from tokcap_vllm import Gate, GateConfig, InProcessServer

    model = build_tiny_model(
        Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense"
    )
    vllm_args = list(VLLM_ARGS)
    vllm_args[vllm_args.index("--max-num-seqs") + 1] = str(args.max_num_seqs)
    with tempfile.TemporaryDirectory() as tmp:
        config = GateConfig(
            capture=CaptureConfig(control_token=TOKEN),
            ledger_path=f"{tmp}/ledger.jsonl",
            parent_commit_timeout_s=600,
        )
        server = InProcessServer(
            str(model), gate=Gate(config, sink=MemorySink()), vllm_args=vllm_args
        )
        with open("/proc/loadavg") as f:
            load_before = f.read().split()[:3]
        server.start()
        try:
            out = anyio.run(_main, server, args)
        finally:
            server.stop()
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]

    calls = args.rollouts * args.turns
    print(
        f"\n{args.rollouts} rollouts x {args.turns} turns = {calls} calls per round, all "
        f"rollouts concurrent, max_tokens={args.max_tokens}, max-num-seqs={args.max_num_seqs}, "
        f"{'captured' if args.captured_first else 'plain'} round first; "
        f"load avg before {' '.join(load_before)}, after {' '.join(load_after)}"
    )
    print(
        "| round | calls answered | errors | wall s | calls/s | p50 ms | p90 ms | p99 ms | max ms "
        "| peak VmRSS MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("plain", "captured"):
        r = out[name]
        lat = r["latencies"]
        ms = [_pct(lat, q) * 1e3 for q in (0.5, 0.9, 0.99)] + [max(lat) * 1e3]
        print(
            f"| {name} | {len(lat)} | {len(r['errors'])} | {r['wall']:.1f} "
            f"| {len(lat) / r['wall']:.1f} | "
            + " | ".join(f"{v:.0f}" for v in ms)
            + f" | {r['rss_peak']:.0f} |"
        )
    p, c = out["plain"]["latencies"], out["captured"]["latencies"]
    added = [(_pct(c, q) - _pct(p, q)) * 1e3 for q in (0.5, 0.9, 0.99)]
    print(
        f"| **added by capture** | | | {out['captured']['wall'] - out['plain']['wall']:+.1f} | | "
        + " | ".join(f"{v:+.0f}" for v in added)
        + " | | |"
    )
    print("\ncustody of the captured round:")
    for k, v in out["custody"].items():
        print(f"  {k}: {v}")
    print(
        f"\nVmRSS MiB: idle {out['rss_idle']:.0f}, after plain {out['rss_after_plain']:.0f}, "
        f"after captured {out['rss_after_captured']:.0f}, after release+clear "
        f"{out['rss_after_release']:.0f}; ru_maxrss {_peak_mib():.0f}"
    )
    for name in ("plain", "captured"):
        for e in out[name]["errors"][:5]:
            print(f"  {name} error: {e}")
    custody = out["custody"]
    lost = len(out["captured"]["errors"]) + custody["calls_not_staged"] + custody["rows_lost"]
    print(f"\nlost calls: {lost}")
    sys.exit(0 if lost == 0 and custody["bad_receipts"] == 0 else 1)


if __name__ == "__main__":
    main()
