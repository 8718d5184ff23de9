"""Core benchmarks: ledger throughput and digest throughput, as ratios within one run.

    uv run python bench/bench_core.py [--rollouts 2000] [--tokens 262144]

1. Ledger: events/s appended (through `Ledger.append`, hashing every entry) and
   replayed (`replay`, re-checking every hash and transition), over many realistic
   rollouts (`simulate_rollout`: 8 calls each, terminal declared, closed). Goal: >= 100k
   events/s.
2. Digest: `StagedCall.compute_digest` over large staged calls vs raw `hashlib.sha256`
   over the same token and logprob bytes. Goal: >= 50 % of raw.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from array import array

from tokcap_core import Ledger, StagedCall
from tokcap_core.ledger import replay
from tokcap_core.simulate import simulate_rollout


def bench_ledger(rollouts: int) -> None:
    simulated = [simulate_rollout(f"r{i}", seed=i, turns=8).ledger for i in range(rollouts)]
    histories = [(s.rollout_id, [entry.event for entry in s.entries]) for s in simulated]
    n_events = sum(len(e) for _, e in histories)
    t0 = time.perf_counter()
    ledgers = []
    for rollout_id, events in histories:
        ledger = Ledger(rollout_id)
        for event in events:
            ledger.append(event)
        ledgers.append(ledger)
    t_append = time.perf_counter() - t0
    t0 = time.perf_counter()
    for ledger in ledgers:
        replay(ledger.rollout_id, ledger.entries)
    t_replay = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_events):
        hashlib.sha256(b"x" * 200).hexdigest()
    t_hash = time.perf_counter() - t0
    print(f"ledger: {rollouts} rollouts, {n_events} events")
    print(f"  append : {n_events / t_append:>12,.0f} events/s   (goal >= 100,000)")
    print(f"  replay : {n_events / t_replay:>12,.0f} events/s   (goal >= 100,000)")
    print(f"  baseline: one raw sha256 of 200 B per event: {n_events / t_hash:,.0f}/s")
    print(f"  append costs {t_append / t_hash:.1f}x that baseline, replay {t_replay / t_hash:.1f}x")


def bench_digest(tokens: int, repeats: int = 20) -> None:
    rng = random.Random(1)
    gen = tokens // 2
    call = StagedCall.from_engine_output(
        rollout_id="bench", call_id="c000001",
        parent_id=None, parent_cum_len=0, parent_chain_hash=None,
        prompt_ids=array("I", (rng.randrange(150_000) for _ in range(tokens - gen))),
        output_ids=array("I", (rng.randrange(150_000) for _ in range(gen))),
        logprobs=array("f", (-rng.random() for _ in range(gen))),
        finish_reason="stop", weight_version=0,
    )  # fmt: skip
    raw = bytes(call.tokens) + bytes(call.logprobs)
    best_ours = best_raw = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call.compute_digest()
        best_ours = min(best_ours, time.perf_counter() - t0)
        t0 = time.perf_counter()
        hashlib.sha256(raw).hexdigest()
        best_raw = min(best_raw, time.perf_counter() - t0)
    mb = len(raw) / 1e6
    print(
        f"digest: staged call of {tokens:,} tokens ({mb:.2f} MB of tokens+logprobs), "
        f"best of {repeats}"
    )
    print(f"  compute_digest : {mb / best_ours:>8.0f} MB/s")
    print(f"  raw sha256     : {mb / best_raw:>8.0f} MB/s")
    print(f"  ratio          : {best_raw / best_ours:>8.1%} of raw   (goal >= 50 %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=262_144)
    args = parser.parse_args()
    bench_ledger(args.rollouts)
    bench_digest(args.tokens)


if __name__ == "__main__":
    main()
