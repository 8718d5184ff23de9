"""TRL's re-tokenising rows against tokcap's captured rows: same multi-turn task, same gate.

One in-process gate (vLLM CPU engine, the tiny model, vLLM's ``hermes`` tool parser, the
demo's ChatML tool template) with TransferQueue and the Ray reassembler pool. Each step,
``--groups`` x ``--rollouts`` agent conversations of ``--turns`` chat calls are played
through the gate with the real ``openai`` client: every call but the last is a forced tool
call (guided decoding, two calls in parallel on the first turn, `tokcap.demo`'s tool and
forcing), the tool answers go back as ``role: "tool"`` messages, the last call answers in
free text. Every call asks for ``return_token_ids``: the engine's own ids for each call are
the reference both paths are compared with. Then, on the same conversations:

- **TRL's path**, with TRL 1.16's own code (``trl.experimental.async_grpo``): what its async
  rollout worker does each turn (``_AsyncRolloutLoop._generate_one``): render the whole
  conversation so far with ``tokenizer.apply_chat_template`` (its arguments: tools,
  ``add_generation_prompt``, the training template where the template is not
  prefix-preserving), pair it with the ids the engine generated in that turn, turn them
  into the assistant message with ``trl.chat_template_utils.parse_response`` (the Qwen3
  response template TRL's ``add_response_schema`` sets for Qwen templates: this ChatML
  tool template is the Qwen layout), append the tool answers as messages; at the end
  ``_chain_to_sequences`` reconciles the turns into rows (``DriftKind`` CLEAN / REALIGN /
  FORK). The generation itself is not TRL's (its worker asks ``/v1/completions`` with no
  way to force a tool call, and the tiny random model never calls one), so the replay
  gives each TRL turn the ids the engine generated in the gate's run of that turn.
- **tokcap's path**: ``Stack.collect`` (close every rollout with its reward, verify the
  receipts against the ledger heads, reassemble the rows on the Ray pool, decide the
  groups) and ``Stack.finish`` (free the rows, release the rollouts).

A row *differs from the engine's ids* when, for some turn it covers, the prompt the engine
ran that turn on followed by what it generated is not, token for token, a prefix of the row
(the context is TRL's own prompt for TRL's rows, the prompt the engine reported for
tokcap's). In TRL's rows a REALIGN overwrites an earlier turn's generated tokens with the
template's re-rendering of them (tool-call JSON re-serialised, text re-encoded), so those
tokens are no longer in the row as the engine generated them. Printed per path: rows, rows
that differ, the first differing position and the generated tokens that are not in the row
as generated; TRL's drift tally (its own); the seconds each path spends per step (the
first step is a warm-up: imports, first compiles, the pool's first round), with the ratio
of tokcap's to TRL's in the same run.

Run: ``uv run tokcap bench bench_trl [--steps 3 --groups 2 --rollouts 4 --turns 4]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokcap

tokcap.prepare_environment()  # before vLLM, torch or Ray are imported

import anyio  # noqa: E402
import openai  # noqa: E402
from _trl_rows import (  # noqa: E402  (bench/ is on sys.path)
    SYSTEM,
    Conversation,
    Diff,
    EngineCall,
    diff,
    engine_turns,
    trl_replay,
    trl_tokenizer,
)

from tokcap.compose import (  # noqa: E402
    Finished,
    Stack,
    in_process_gate,
    open_stack,
    play_rollouts,
    services,
    tq_sink,
)
from tokcap.demo import (  # noqa: E402
    QWEN_VLLM_ARGS,
    ask_with_tools,
    engine_reported,
    tool_calls_of,
    tool_result,
)
from tokcap.tiny import build_tiny_model  # noqa: E402
from tokcap_core import CaptureConfig, TrainingRow  # noqa: E402
from tokcap_tq import TQSink  # noqa: E402
from tokcap_vllm import InProcessServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOOL_TOKENS, ANSWER_TOKENS = 256, 24


async def play(
    turns: int, client: openai.AsyncOpenAI, model: str, conversation: Conversation, n: int
) -> None:
    """The harness: ``turns`` chat calls, tool calls forced on all but the last."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": conversation.question},
    ]
    response_id = ""
    for turn in range(turns):
        last = turn == turns - 1
        reply = await ask_with_tools(
            client,
            model,
            messages,
            max_tokens=ANSWER_TOKENS if last else TOOL_TOKENS,
            seed=n * 1000 + turn,
            force=0 if last else (2 if turn == 0 else 1),
        )
        choice = reply.choices[0]
        response_id = reply.id
        conversation.calls.append(EngineCall(*engine_reported(reply)))
        calls = tool_calls_of(choice.message)
        assistant: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        messages += [
            {"role": "tool", "tool_call_id": c["id"], "content": tool_result(c)} for c in calls
        ]
        if last or not calls:
            break
    reward = float(len(choice.message.content or "") % 7) / 6  # a spread of rewards
    conversation.finished = Finished(
        conversation.rollout_id, conversation.group_id, reward, response_id=response_id
    )


@dataclass(slots=True)
class Tally:
    """Both paths' figures over the run."""

    trl_rows: int = 0
    trl_diffs: list[Diff] = field(default_factory=list)
    trl_drift: dict[str, float] = field(default_factory=dict)
    trl_s: list[float] = field(default_factory=list)
    tokcap_rows: int = 0
    tokcap_diffs: list[Diff] = field(default_factory=list)
    tokcap_s: list[float] = field(default_factory=list)
    tokcap_stages: dict[str, list[float]] = field(default_factory=dict)
    conversations: int = 0
    calls: int = 0


def tokcap_diffs(
    rows: Sequence[TrainingRow], conversations: Sequence[Conversation]
) -> list[Diff | None]:
    """Each valid row against every call of its rollout as the engine reported it."""
    turns = {c.rollout_id: engine_turns(c) for c in conversations}
    return [diff(list(r.input_ids), turns[r.rollout_id]) for r in rows if r.sample_mask]


async def step(
    stack: Stack, tokenizer: Any, args: argparse.Namespace, s: int, tally: Tally
) -> None:
    """Play one step's conversations, then run both paths on them."""
    conversations = [
        Conversation(f"trl-s{s}-g{g}-r{r}", f"trl-s{s}-g{g}", f"What is {3 + g} * {4 + s}?")
        for g in range(args.groups)
        for r in range(args.rollouts)
    ]
    await play_rollouts(
        stack.gate, conversations, functools.partial(play, args.turns), concurrency=8
    )
    tally.conversations += len(conversations)
    tally.calls += sum(len(c.calls) for c in conversations)
    t0 = time.perf_counter()
    replays = [trl_replay(tokenizer, c) for c in conversations]
    tally.trl_s.append(time.perf_counter() - t0)
    for replay in replays:
        tally.trl_rows += len(replay.rows)
        tally.trl_diffs += [
            d for r, t in zip(replay.rows, replay.turns_of_row, strict=True) if (d := diff(r, t))
        ]
        for key, value in replay.tally.items():
            if key == "drift_max":
                tally.trl_drift[key] = max(tally.trl_drift.get(key, 0.0), value)
            else:
                tally.trl_drift[key] = tally.trl_drift.get(key, 0.0) + value
    t0 = time.perf_counter()
    batch = await stack.collect([c.finished for c in conversations if c.finished is not None])
    done = await stack.finish(batch)
    tally.tokcap_s.append(time.perf_counter() - t0)
    assert batch.timings is not None
    for name, value in (
        ("close + verify", batch.timings.close_s),
        ("reassemble + decide", batch.timings.reassemble_s),
        ("fetch rows + advantages", batch.timings.rows_s),
        ("free + release", done.free_s + done.release_s),
    ):
        tally.tokcap_stages.setdefault(name, []).append(value)
    tally.tokcap_rows += sum(r.sample_mask for r in batch.rows)
    tally.tokcap_diffs += [d for d in tokcap_diffs(batch.rows, conversations) if d is not None]
    print(
        f"step {s}: receipts verified {batch.receipts_verified}/{len(batch.receipts)}, "
        f"TRL {tally.trl_s[-1] * 1e3:.1f} ms, tokcap {tally.tokcap_s[-1] * 1e3:.1f} ms",
        flush=True,
    )


def describe(name: str, rows: int, diffs: Sequence[Diff]) -> str:
    """One path's row line."""
    if not diffs:
        return f"  {name:<22} rows {rows:>4}, differing from the engine's ids    0"
    firsts = sorted(d.first for d in diffs)
    affected = sum(d.affected for d in diffs)
    return (
        f"  {name:<22} rows {rows:>4}, differing from the engine's ids {len(diffs):>4} "
        f"({len(diffs) / max(rows, 1):.0%}); first differing position min {firsts[0]} / "
        f"median {statistics.median(firsts):.0f}; generated tokens not in the row as "
        f"generated {affected} ({affected / len(diffs):.1f} per differing row)"
    )


def report(tally: Tally, args: argparse.Namespace, load: tuple[float, ...]) -> None:
    """Print the comparison."""
    d = tally.trl_drift
    print()
    print(
        f"load average {' '.join(f'{x:.2f}' for x in load)} (at the start), {os.cpu_count()} cores"
    )
    print(
        f"{args.steps} steps x {args.groups * args.rollouts} conversations, up to "
        f"{args.turns} chat calls each ({tally.calls} calls in {tally.conversations} conversations)"
    )
    print("rows:")
    print(describe("TRL (re-tokenised)", tally.trl_rows, tally.trl_diffs))
    print(describe("tokcap (captured)", tally.tokcap_rows, tally.tokcap_diffs))
    transitions = int(d.get("transitions", 0))
    print(
        f"  TRL's reconciler over {transitions} turn transitions: clean {int(d.get('clean', 0))}, "
        f"realign {int(d.get('realign', 0))}, fork {int(d.get('fork', 0))}; "
        f"drift {int(d.get('drift_tokens', 0))} tokens (max {int(d.get('drift_max', 0))})"
    )
    timed = slice(1, None) if len(tally.trl_s) > 1 else slice(None)  # the first: a warm-up
    trl = statistics.mean(tally.trl_s[timed])
    ours = statistics.mean(tally.tokcap_s[timed])
    print(f"per step (mean over {len(tally.trl_s[timed])} steps after the warm-up):")
    print(f"  TRL re-tokenise + parse + reconcile   {trl * 1e3:9.1f} ms   1.00x (baseline)")
    print(f"  tokcap close + verify + reassemble    {ours * 1e3:9.1f} ms   {ours / trl:.2f}x")
    for name, values in tally.tokcap_stages.items():
        print(f"    {name:<34}{statistics.mean(values[timed]) * 1e3:9.1f} ms")


async def run(
    server: InProcessServer,
    sink: TQSink,
    capture: CaptureConfig,
    args: argparse.Namespace,
    model: Path,
) -> Tally:
    """Start the stack, play and compare ``args.steps`` steps."""
    tokenizer = trl_tokenizer(model)
    tally = Tally()
    ready = functools.partial(anyio.to_thread.run_sync, server.wait_ready)
    async with open_stack(
        [server], sink=sink, capture=capture, workers=1, alongside=[ready]
    ) as stack:
        for s in range(args.steps):
            await step(stack, tokenizer, args, s, tally)
    return tally


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the counts, start the gate, run, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("steps", 3), ("groups", 2), ("rollouts", 4), ("turns", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    capture = CaptureConfig(
        segments="terminal", min_valid_fraction=0.5, return_token_ids=True
    ).with_derived(environ=os.environ)
    sink = tq_sink("bench-trl")
    model = build_tiny_model(REPO / ".tokcap" / "tiny" / "dense", kind="dense")
    server = in_process_gate(str(model), capture=capture, sink=sink, vllm_args=QWEN_VLLM_ARGS)
    with services(server, workers=1):
        tally = anyio.run(run, server, sink, capture, args, model)
    report(tally, args, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
