"""Reassembly vs re-tokenising, same run, same trajectories.

Builds multi-turn ChatML trajectories on the tiny local tokenizer. Every assistant turn's
ids are what an engine might sample: usually the canonical encoding of some text, but
now and then a merged token is emitted as its two BPE parts, or an arbitrary vocabulary
id appears (decode→encode is not identity). Each turn is staged as a gate would stage it
(`StagedCall.from_engine_output`, a real `Ledger`, `assemble_receipt`); then we time

* reassembly: ``reassemble(receipt, staged, max_seq_len=...)`` per trajectory, which
  verifies every call (digests over all tokens and logprobs, chain hashes) and builds
  the row; also replay of the ledger + receipt + reassembly;
* re-tokenising: decode each assistant turn's ids, render the whole conversation with
  the chat template and encode it, as a trainer that re-tokenises does (a lower bound:
  no mask computation);

and count the re-tokenised trajectories whose ids differ from the captured ones.

Run: ``.venv/bin/python bench/bench_reassembly.py [--trajectories 16 --turns 30]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokcap_core import Ledger, Receipt, StagedCall, assemble_receipt, reassemble
from tokcap_core.ledger import Closed, TerminalDeclared, replay
from tokcap_core.simulate import admit_call, stage_call

REPO = Path(__file__).resolve().parent.parent
SPLIT_RATES = (0.0, 0.001, 0.005, 0.02)
"""Per-token chance that an assistant token is emitted as its two BPE parts, per trajectory."""
RANDOM_ID_SHARE = 0.1
"""Arbitrary vocabulary ids, as a share of the split rate."""
FIRST_ORDINARY_ID = 3  # ids 0..2 are the specials


@dataclass
class Trajectory:
    rollout_id: str
    messages: list[dict[str, str]]
    captured: list[int]
    calls: dict[str, StagedCall]
    ledger: Ledger
    receipt: Receipt
    split_rate: float
    call_starts: list[int]


class EngineSampler:
    """Turns text into ids the way an engine's sampler may: not always canonically."""

    def __init__(self, tokenizer: Any, tokenizer_json: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
        self.splits: dict[int, tuple[int, int]] = {}
        for merge in tokenizer_json["model"]["merges"]:
            left, right = merge if isinstance(merge, list) else merge.split(" ")
            self.splits[vocab[left + right]] = (vocab[left], vocab[right])
        self.vocab_size = len(tokenizer)

    def sample(self, text: str, rng: random.Random, split_rate: float) -> list[int]:
        ids: list[int] = []
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            roll = rng.random()
            if roll < split_rate * RANDOM_ID_SHARE:
                ids.append(rng.randrange(FIRST_ORDINARY_ID, self.vocab_size))
            elif roll < split_rate and token in self.splits:
                ids.extend(self.splits[token])
            else:
                ids.append(token)
        return ids


def corpus_text(limit_files: int = 400) -> str:
    """Text to draw observations and answers from: stdlib sources outside the training files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*/*.py"))[:limit_files]
    return "\n".join(p.read_bytes().decode("utf-8", errors="replace") for p in files)


def chunk(corpus: str, rng: random.Random, chars: int) -> str:
    start = rng.randrange(0, len(corpus) - chars - 1)
    start = corpus.find("\n", start) + 1
    return corpus[start : start + chars].strip("\n") or "pass"


def build_trajectory(
    index: int,
    *,
    tokenizer: Any,
    sampler: EngineSampler,
    corpus: str,
    turns: int,
    rng: random.Random,
) -> Trajectory:
    """One rollout: system + task, then ``turns`` assistant calls with tool observations between."""
    rollout_id = f"bench-{index:03d}"
    split_rate = SPLIT_RATES[index % len(SPLIT_RATES)]
    target_tokens = rng.randint(8_000, 32_000)
    chars_per_turn = target_tokens * 8 // (3 * turns)  # ~2.7 characters per token on code
    ledger = Ledger(rollout_id)
    calls: dict[str, StagedCall] = {}
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Use tools."},
        {
            "role": "user",
            "content": "Fix the failing test.\n" + chunk(corpus, rng, chars_per_turn // 2),
        },
    ]
    suffix_text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    eos = tokenizer.eos_token_id
    parent: StagedCall | None = None
    history: list[int] = []
    call_starts: list[int] = []
    for turn in range(turns):
        call_id = admit_call(
            ledger, parent, admitted_at=turn, request_fingerprint=f"req-{index}-{turn}"
        )
        # token_in: the parent's exact cumulative ids + the rendered suffix of the new messages
        prompt = history + tokenizer.encode(suffix_text, add_special_tokens=False)
        answer = chunk(corpus, rng, int(chars_per_turn * 0.4))
        output = [*sampler.sample(answer, rng, split_rate), eos]
        logprobs = [-rng.random() * 3 for _ in output]
        call = stage_call(
            ledger, call_id, parent, prompt_ids=prompt, output_ids=output, logprobs=logprobs
        )
        calls[call.key] = call
        call_starts.append(len(history))
        history = prompt + output
        parent = call
        # what the harness saw and sends back next time: the decoded text, then a tool result
        messages.append({"role": "assistant", "content": tokenizer.decode(output[:-1])})
        observation = {"role": "tool", "content": chunk(corpus, rng, int(chars_per_turn * 0.6))}
        messages.append(observation)
        # ChatML puts "\n" after <|im_end|>; the engine stopped at <|im_end|>, so the next
        # prompt's suffix starts with that newline (verl #3720).
        suffix_text = "\n" + tokenizer.apply_chat_template(
            [observation], add_generation_prompt=True, tokenize=False
        )
    messages.pop()  # the rollout ends on the last assistant turn
    assert parent is not None
    ledger.append(TerminalDeclared(by="call_id", value=parent.call_id))
    ledger.append(Closed(reward=1.0))
    return Trajectory(
        rollout_id=rollout_id,
        messages=messages,
        captured=history,
        calls=calls,
        ledger=ledger,
        receipt=assemble_receipt(ledger.state),
        split_rate=split_rate,
        call_starts=call_starts,
    )


def retokenise(tokenizer: Any, trajectory: Trajectory) -> list[int]:
    """What a re-tokenising trainer trains on: the rendered conversation, encoded."""
    text = tokenizer.apply_chat_template(trajectory.messages, tokenize=False)
    text = text.removesuffix(
        "\n"
    )  # the engine stopped at <|im_end|>; don't count the template's "\n"
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` runs of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=REPO / ".tokcap" / "tiny" / "tokenizer")
    args = parser.parse_args(argv)

    import json

    import transformers

    from tokcap.tiny import build_tiny_tokenizer

    print(f"[1/4] tiny tokenizer in {args.cache}", flush=True)
    tok_dir = build_tiny_tokenizer(args.cache)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.model_max_length = 1 << 30  # whole trajectories are encoded; no model sees them
    sampler = EngineSampler(tokenizer, json.loads((tok_dir / "tokenizer.json").read_text()))
    corpus = corpus_text()
    rng = random.Random(args.seed)

    print(f"[2/4] staging {args.trajectories} trajectories x {args.turns} turns", flush=True)
    trajectories = []
    for i in range(args.trajectories):
        trajectories.append(
            build_trajectory(
                i, tokenizer=tokenizer, sampler=sampler, corpus=corpus, turns=args.turns, rng=rng
            )
        )
        print(f"      {i + 1}/{args.trajectories}", end="\r", flush=True)
    print()
    total_tokens = sum(len(t.captured) for t in trajectories)
    max_len = max(len(t.captured) for t in trajectories)
    max_seq_len = max_len + 1

    rows = [reassemble(t.receipt, t.calls, max_seq_len=max_seq_len)[0] for t in trajectories]
    for t, row in zip(trajectories, rows, strict=True):
        assert list(row.input_ids) == t.captured, t.rollout_id

    print(f"[3/4] timing, median of {args.repeats}", flush=True)

    def run_reassembly() -> None:
        for t in trajectories:
            reassemble(t.receipt, t.calls, max_seq_len=max_seq_len)

    def run_replay_receipt_reassembly() -> None:
        for t in trajectories:
            receipt = assemble_receipt(replay(t.rollout_id, t.ledger.entries))
            reassemble(receipt, t.calls, max_seq_len=max_seq_len)

    def run_retokenise() -> None:
        for t in trajectories:
            retokenise(tokenizer, t)

    t_reassemble = timed(run_reassembly, args.repeats)
    t_full = timed(run_replay_receipt_reassembly, args.repeats)
    t_retok = timed(run_retokenise, args.repeats)

    print("[4/4] drift of re-tokenised ids against captured ids\n", flush=True)
    retokenised = [retokenise(tokenizer, t) for t in trajectories]
    rate = {
        "reassemble (verify + build)": total_tokens / t_reassemble,
        "replay + receipt + reassemble": total_tokens / t_full,
        "re-tokenise (decode + template + encode)": total_tokens / t_retok,
    }
    width = max(map(len, rate))
    print(
        f"{args.trajectories} trajectories, {args.turns} turns, {total_tokens:,} tokens "
        f"({min(len(t.captured) for t in trajectories):,}..{max_len:,} per trajectory)"
    )
    print(f"{'method':<{width}}  {'seconds':>9}  {'tokens/s':>14}  {'vs re-tokenise':>14}")
    for (name, tps), seconds in zip(rate.items(), (t_reassemble, t_full, t_retok), strict=True):
        ratio = tps / rate["re-tokenise (decode + template + encode)"]
        print(f"{name:<{width}}  {seconds:>9.4f}  {tps:>14,.0f}  {ratio:>13.1f}x")

    print(f"\n{'split rate':>10}  {'trajectories':>12}  {'re-tokenised differ':>19}")
    for split_rate in SPLIT_RATES:
        group = [
            (t, ids)
            for t, ids in zip(trajectories, retokenised, strict=True)
            if t.split_rate == split_rate
        ]
        differ = sum(ids != t.captured for t, ids in group)
        print(f"{split_rate:>10}  {len(group):>12}  {differ:>19}")
    differing = [
        (t, ids) for t, ids in zip(trajectories, retokenised, strict=True) if ids != t.captured
    ]
    print(f"total: {len(differing)}/{len(trajectories)} re-tokenised trajectories differ")
    for t, ids in differing[:4]:
        at = first_difference(t.captured, ids)
        assert at is not None
        turn = max(i for i, start in enumerate(t.call_starts) if start <= at)
        print(
            f"  {t.rollout_id}: first difference at token {at} (call {turn + 1}), "
            f"captured {t.captured[at : at + 3]} vs re-tokenised {ids[at : at + 3]}, "
            f"lengths {len(t.captured)} vs {len(ids)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
