"""Load: many concurrent multi-turn rollouts through one gate, with plain rounds to compare.

One in-process vLLM CPU server (tiny model, fast-start settings as in tests/vllm) with the
gate installed over a `MemorySink`, ledger persisted to a file, control token set. Rounds
of the *same* conversations at the *same* concurrency (every rollout runs its turns in
sequence, all rollouts at once), through one `openai.AsyncOpenAI` connection pool:

- **plain**: ``/v1/chat/completions`` (the middleware routes it to vLLM untouched);
- **captured**: ``/tokcap/rollouts/{id}/v1/chat/completions`` (admission, token_in,
  staging, ledger commit).

``--order`` says which rounds run, in order (default ``pccp``: plain, captured, captured,
plain, so drift and warm-up hit both kinds alike). After each captured round every one of
its rollouts is closed and its receipt fetched over the control plane
(`ControlPlaneClient.fetch_receipts`, heads kept at close), and the harness's view is
checked against custody: every call the harness got a response for is ``Staged`` in the
ledger under the response id it saw, its row is in the sink, receipts verify and name
every call of the rollout's chain, no staging key is duplicated or extra. The rollouts are
then released and their keys cleared: the sink must be empty and the gate must hold none.

Memory: VmRSS of this process (gate, API server, harness) sampled every 0.25 s per round,
plus ``ru_maxrss``; vLLM's engine core (a child process) sampled alike, plus its VmHWM.
The harness shares the process (and the GIL) with the server, so latencies are end to end
on a loaded box; *added* latency is captured minus plain of the same percentile, over all
rounds of each kind.

    .venv/bin/python bench/load_gate.py [--rollouts 1000] [--turns 4] [--max-tokens 8]
        [--max-num-seqs 256] [--order pccp]
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

from _harness import set_engine_env  # bench/ is on sys.path

set_engine_env()

from _procmem import descendants, role_of, status_mib  # noqa: E402  (bench/ is on sys.path)

TOKEN = "load-bench-" + os.urandom(8).hex()


def _rss_mib() -> float:
    return status_mib("VmRSS")


def _engine_rss_mib(field: str = "VmRSS") -> float:
    """vLLM's engine core (a child process)."""
    pids = [pid for pid in descendants() if role_of(pid) == "engine core"]
    return sum(status_mib(field, pid) for pid in pids) or float("nan")


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
    rss_peak, engine_peak = _rss_mib(), _engine_rss_mib()
    done = anyio.Event()

    async def sample() -> None:
        nonlocal rss_peak, engine_peak
        while not done.is_set():
            rss_peak = max(rss_peak, _rss_mib())
            engine_peak = max(engine_peak, _engine_rss_mib())
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
        "engine_peak": engine_peak,
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
    return dict(gate.rollouts())


async def _main(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(
        max_connections=args.rollouts + 100, max_keepalive_connections=args.rollouts + 100
    )
    rounds: list[tuple[str, dict[str, Any]]] = []
    custody: list[dict[str, Any]] = []
    memory: list[tuple[str, float, float]] = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0)) as http:
        common = {"turns": args.turns, "max_tokens": args.max_tokens}
        warm = await _round(server, http, captured=True, tag="warm", rollouts=8, **common)
        await _round(server, http, captured=False, tag="warm", rollouts=8, **common)
        await _custody(server, warm["responses"], args.turns)
        memory.append(("idle after warm-up", _rss_mib(), _engine_rss_mib()))
        for n, letter in enumerate(args.order):
            kind = "captured" if letter == "c" else "plain"
            result = await _round(
                server,
                http,
                captured=kind == "captured",
                tag=f"{letter}{n}",
                rollouts=args.rollouts,
                **common,
            )
            rounds.append((kind, result))
            memory.append((f"after {kind} round {n}", _rss_mib(), _engine_rss_mib()))
            if kind == "captured":
                custody.append(await _custody(server, result["responses"], args.turns))
                memory.append((f"after release+clear {n}", _rss_mib(), _engine_rss_mib()))
    return {"rounds": rounds, "custody": custody, "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--order", default="pccp", help="the rounds, in order: p = plain, c = captured"
    )
    args = parser.parse_args()
    if not args.order or set(args.order) - {"p", "c"} or len(set(args.order)) != 2:
        parser.error("--order is a string of p and c holding both")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import anyio

    from tests.vllm._helpers import VLLM_ARGS
    from tokcap.tiny import build_tiny_model
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
        server.start()
        load_before = _loadavg()
        try:
            out = anyio.run(_main, server, args)
            engine_hwm = _engine_rss_mib("VmHWM")
        finally:
            server.stop()
    load_after = _loadavg()
    _report(args, out, load_before, load_after, engine_hwm)


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _report(
    args: argparse.Namespace,
    out: dict[str, Any],
    load_before: str,
    load_after: str,
    engine_hwm: float,
) -> None:
    calls = args.rollouts * args.turns
    print(
        f"\n{args.rollouts} rollouts x {args.turns} turns = {calls} calls per round, all "
        f"rollouts concurrent, max_tokens={args.max_tokens}, max-num-seqs={args.max_num_seqs}, "
        f"rounds {args.order}; 1-min/5-min/15-min load before {load_before}, after {load_after}"
    )
    print(
        "| round | calls answered | errors | wall s | calls/s | p50 ms | p90 ms | p99 ms | max ms "
        "| peak VmRSS MiB (server) | peak VmRSS MiB (engine core) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    pooled: dict[str, list[float]] = {"plain": [], "captured": []}
    walls: dict[str, float] = {"plain": 0.0, "captured": 0.0}
    for n, (kind, r) in enumerate(out["rounds"]):
        lat = r["latencies"]
        pooled[kind] += lat
        walls[kind] += r["wall"]
        ms = [_pct(lat, q) * 1e3 for q in (0.5, 0.9, 0.99)] + [max(lat, default=0) * 1e3]
        print(
            f"| {n}: {kind} | {len(lat)} | {len(r['errors'])} | {r['wall']:.1f} "
            f"| {len(lat) / r['wall']:.1f} | "
            + " | ".join(f"{v:.0f}" for v in ms)
            + f" | {r['rss_peak']:.0f} | {r['engine_peak']:.0f} |"
        )
    p, c = pooled["plain"], pooled["captured"]
    added = [(_pct(c, q) - _pct(p, q)) * 1e3 for q in (0.5, 0.9, 0.99)]
    share = [(_pct(c, q) / _pct(p, q) - 1) * 100 for q in (0.5, 0.9, 0.99)]
    print(
        f"| **added by capture** (all rounds of each kind) | | | "
        f"{walls['captured'] - walls['plain']:+.1f} | | "
        + " | ".join(f"{v:+.0f} ({pct:+.1f} %)" for v, pct in zip(added, share, strict=True))
        + " | | | |"
    )
    for n, custody in enumerate(out["custody"]):
        print(f"\ncustody of captured round {n + 1}:")
        for k, v in custody.items():
            print(f"  {k}: {v}")
    print("\nVmRSS MiB (server process / engine core):")
    for label, rss, engine in out["memory"]:
        print(f"  {label}: {rss:.0f} / {engine:.0f}")
    print(f"  ru_maxrss (server) {_peak_mib():.0f}; VmHWM (engine core) {engine_hwm:.0f}")
    for kind, r in out["rounds"]:
        for e in r["errors"][:5]:
            print(f"  {kind} error: {e}")
    lost = sum(len(r["errors"]) for kind, r in out["rounds"] if kind == "captured") + sum(
        c["calls_not_staged"] + c["rows_lost"] for c in out["custody"]
    )
    bad = sum(c["bad_receipts"] for c in out["custody"])
    print(f"\nlost calls: {lost}; receipts not verified: {bad}")
    sys.exit(0 if lost == 0 and bad == 0 else 1)


if __name__ == "__main__":
    main()
