"""Closed-loop training in one run: step time by stage, weight-push cost, parity vs re-tokenising.

1. **Step time.** The `tokcap train` loop (tiny fp32 model, agent task, 4 x 8 rollouts of
   two 16-token calls a step) through the whole product for ``--steps`` steps. Per stage
   the mean seconds over steps 1.. (step 0 warms up) and its share of the step. Stages are
   wall-clock segments: generate (until the last answer), capture + verify and reassemble
   (the step's one collection of every group, after the last answer), train, push.
   ``tokcap share of a step`` is that blocking part over the step's wall time
   (`tokcap.loop.tokcap_share`). The collection's parts are printed apart (close, receipts
   it left out, the reassemblers' bundles, reading rows), as is ``finish`` (free rows,
   release rollouts), which overlaps the next step.
2. **Parity vs re-tokenised text.** On the last step's rows, before its optimizer step (the
   trainer holds the weights that sampled them): the trainer's logprobs on the ids the gate
   captured (what `tokcap train` uses) against the engine's, and, as the baseline a
   text-based trainer would have, on the transcript re-tokenised through the chat template,
   paired with the engine's per-token logprobs by position over the answer. Reported: mean
   and max |Δ|, K3, rows whose ids change, answer tokens per row, and the gap in the
   answer's log-probability (nats) between the sampled ids and the re-tokenised ones.
3. **Push cost.** `bench_push.bench_model` for the tiny model and a ~100M-parameter random
   Qwen3 of the same family: a full-state-dict push over RPC and shared memory, against
   vLLM's file route and an in-memory copy, with parity around the push.

The machine's load average is printed at the start and the end: on a shared 2-core box the
seconds move with it; the shares and the parity figures much less.

Run: ``.venv/bin/python bench/bench_train.py [--steps 8] [--pushes 3] [--skip-large]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokcap

tokcap.prepare_environment()  # the CPU engine's environment defaults, before vLLM
tokcap.quiet_third_parties()

STAGES = ("generate", "capture_verify", "reassemble", "train", "push")
WORK = ("close", "fetch_receipts", "pool", "read_rows")
ACTOR = ("time/fetch_ms", "time/reassemble_ms", "time/publish_ms", "time/clear_ms")
AHEAD = ("staging/read_ahead_keys", "staging/missing_keys")
ACTOR_MS: list[dict[str, float]] = []
"""Each group's timings in the Ray pool's actor (steps 1..): read staged calls, verify and
reassemble, publish rows, clear the staged calls (a bundle's groups share its fetch and
publish)."""


@dataclass(slots=True)
class RetokFigures:
    """The last step's rows scored two ways (see the module docstring, part 2)."""

    rows: int = 0
    captured: Any = None
    """`LogprobParity` of the trainer on the captured ids (the loss-masked answer tokens)."""
    retokenized: Any = None
    """`LogprobParity` of the trainer on re-tokenised ids, paired by answer position."""
    rows_changed: int = 0
    prompt_changed: int = 0
    tokens_sampled: list[int] = field(default_factory=list)
    tokens_retok: list[int] = field(default_factory=list)
    sequence_gap: list[float] = field(default_factory=list)


def _answer_logprobs(model: Any, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 (index t-1), fp32, no gradient."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
    return [0.0, *picked.tolist()]


def transcript(episode: Any, task: str) -> list[dict[str, str]]:
    """The chat a text-based trainer would rebuild from ``episode``: every answer, and
    between them what the environment said (`tokcap.loop.tool_response`)."""
    from tokcap.loop import MORE, SYSTEM, tool_response

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": episode.prompt}]
    for turn, answer in enumerate(episode.contents):
        if turn:
            said = MORE if task == "digits" else tool_response(episode.contents[turn - 1])
            messages.append({"role": "user", "content": said})
        messages.append({"role": "assistant", "content": answer})
    return messages


def retokenization_figures(
    model: Any, tokenizer: Any, episodes: list[Any], rows: list[Any], task: str
) -> RetokFigures:
    """Score ``rows`` on their captured ids and on their re-tokenised transcript.

    A row holds every call of its rollout (answers, and the environment's turns between
    them, outside the loss); both sides are compared over the sampled positions only (the
    captured row's loss mask), paired by position from the end of the first prompt.
    """
    from tokcap_core import logprob_parity

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_id = {e.rollout_id: e for e in episodes}
    figures = RetokFigures()
    engine_N, captured_N, retok_engine_N, retok_N, masks, retok_masks = [], [], [], [], [], []
    for row in rows:
        if not row.sample_mask or row.segment != 0:
            continue
        episode = by_id[row.rollout_id]
        ids, start = list(row.input_ids), row.prompt_len
        sampled = ids[start:]
        engine = list(row.logprobs[start:])
        mask = list(row.loss_mask[start:])
        if sampled and sampled[-1] == end:  # the answer's text ends before the stop token
            sampled, engine, mask = sampled[:-1], engine[:-1], mask[:-1]
        rendered = tokenizer.apply_chat_template(transcript(episode, task), tokenize=True)
        retok = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        last_end = len(retok) - 1 - retok[::-1].index(end)
        answer = retok[start:last_end]
        figures.rows += 1
        figures.prompt_changed += retok[:start] != ids[:start]
        figures.rows_changed += answer != sampled
        figures.tokens_sampled.append(sum(mask))
        figures.tokens_retok.append(len(answer) - (len(sampled) - sum(mask)))
        trainer_captured = _answer_logprobs(model, ids)
        trainer_retok = _answer_logprobs(model, retok)
        engine_N.append(list(row.logprobs))
        captured_N.append(trainer_captured)
        masks.append(list(row.loss_mask))
        paired = min(len(sampled), len(answer))
        retok_engine_N.append(engine[:paired])
        retok_N.append(trainer_retok[start : start + paired])
        retok_masks.append(mask[:paired])
        figures.sequence_gap.append(
            abs(
                sum(e for e, m in zip(engine, mask, strict=True) if m)
                - sum(t for t, m in zip(trainer_retok[start:], mask, strict=False) if m)
            )
        )
    figures.captured = logprob_parity(engine_N, captured_N, masks)
    figures.retokenized = logprob_parity(retok_engine_N, retok_N, retok_masks)
    return figures


def run_loop_bench(steps: int) -> tuple[Any, RetokFigures | None]:
    """The `tokcap train` loop for ``steps`` steps; the last step's rows scored both ways."""
    from transformers import AutoTokenizer

    from tokcap.loop import LoopConfig, run_loop
    from tokcap.tiny import build_tiny_model

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    model_dir = build_tiny_model(cache / "dense", kind="dense")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    found: list[RetokFigures] = []
    config = LoopConfig(model=model_dir, steps=steps)

    def observe(step: int, episodes: list[Any], batch: Any, trainer: Any) -> None:
        if step:  # after the warm-up step: what the pool's actors spent per group
            ACTOR_MS.extend(
                {k: g.metrics.get(k, 0.0) for k in (*ACTOR, *AHEAD)} for g in batch.groups
            )
        if step == steps - 1:
            try:
                found.append(
                    retokenization_figures(
                        trainer.model, tokenizer, episodes, batch.rows, config.task
                    )
                )
            except Exception as e:  # the step figures still print
                print(f"re-tokenisation figures failed: {e!r}", file=sys.stderr)

    run = run_loop(config, observe=observe)
    return run, (found[0] if found else None)


def print_steps(run: Any) -> None:
    from tokcap.loop import tokcap_share

    measured = run.steps[1:] or run.steps
    mean = {k: statistics.mean(s.seconds.get(k, 0.0) for s in measured) for k in STAGES}
    total = sum(mean.values())
    finish = statistics.mean(s.seconds.get("finish", 0.0) for s in measured)
    rewards = [s.reward_mean for s in run.steps]
    print(f"\n== step time by stage ({len(measured)} steps after a warm-up step)")
    print(f"{'stage':28}{'mean s':>10}{'share':>9}")
    for name in STAGES:
        print(f"{name:28}{mean[name]:10.3f}{mean[name] / total:9.1%}")
    print(f"{'step (sum of stages)':28}{total:10.3f}{1:9.0%}")
    print(f"{'finish (overlaps next step)':28}{finish:10.3f}")
    work = {k: statistics.mean(s.seconds.get(k, 0.0) for s in measured) for k in WORK}
    print("the collection's parts (mean s): " + ", ".join(f"{k} {v:.3f}" for k, v in work.items()))
    if ACTOR_MS:
        print(
            "reassembly in the pool's actors (mean ms over groups; a bundle's groups share "
            "its fetch and publish): "
            + ", ".join(
                f"{k.removeprefix('time/').removesuffix('_ms')} "
                f"{statistics.mean(g[k] for g in ACTOR_MS):.1f}"
                for k in ACTOR
            )
        )
        ahead, missing = (statistics.mean(g[k] for g in ACTOR_MS) for k in AHEAD)
        print(
            f"staged calls a group, read ahead while the close ran: {ahead:.1f}"
            f" (missing from the sink: {missing:.1f})"
        )
    share = statistics.mean(tokcap_share(s.seconds) for s in measured)
    print(f"tokcap share of a step: {share * 100:.1f} %")
    k3 = max(s.parity["k3"] for s in run.steps)
    print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; max parity K3 over steps {k3:.1e}")


def print_retok(figures: RetokFigures, run: Any) -> None:
    last = run.steps[-1]
    print(
        f"\n== parity of step {last.step}'s {figures.rows} rows (reward {last.reward_mean:.3f}; "
        "trainer == engine weights)"
    )
    print(f"{'':34}{'mean |d|':>10}{'max |d|':>10}{'K3':>10}{'ids changed':>14}")
    cap, ret = figures.captured, figures.retokenized
    print(f"{'captured ids (tokcap)':34}{cap.mean_abs:10.1e}{cap.max_abs:10.1e}{cap.k3:10.1e}"
          f"{0:>8}/{figures.rows}")  # fmt: skip
    print(f"{'re-tokenised text (by position)':34}{ret.mean_abs:10.1e}{ret.max_abs:10.1e}"
          f"{ret.k3:10.1e}{figures.rows_changed:>8}/{figures.rows}")  # fmt: skip
    sampled, retok = figures.tokens_sampled, figures.tokens_retok
    print(
        f"sampled tokens per row: captured {statistics.mean(sampled):.2f}, re-tokenised "
        f"{statistics.mean(retok):.2f} (about); answer log-probability gap "
        f"{statistics.mean(figures.sequence_gap):.2f} nats/row (max "
        f"{max(figures.sequence_gap):.2f}); prompts re-rendered differently: "
        f"{figures.prompt_changed}/{figures.rows}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    run, figures = run_loop_bench(args.steps)
    print_steps(run)
    if figures is not None:
        print_retok(figures, run)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tempfile

    import bench_push  # type: ignore[import-not-found]  # bench/ is not a package

    from tokcap.tiny import build_tiny_model

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    tiny = build_tiny_model(cache / "dense", kind="dense")
    results = [bench_push.bench_model("tiny", tiny, args.pushes)]
    if not args.skip_large:
        with tempfile.TemporaryDirectory(prefix="tokcap-push-") as tmp:
            large = bench_push.build_large(tiny, Path(tmp) / "large")
            results.append(bench_push.bench_model("~100M", large, max(2, args.pushes)))
    print("\n== weight push, full state dict (median)")
    print(f"{'model':8}{'params':>10}{'MB':>9}{'rpc ms':>10}{'shm ms':>10}{'file ms':>10}"
          f"{'file/rpc':>10}")  # fmt: skip
    for r in results:
        ratio = r["file_ms"] / r["push_ms"]
        print(f"{r['model']:8}{r['params'] / 1e6:9.1f}M{r['mb']:9.1f}{r['push_ms']:10.1f}"
              f"{r['shm_ms']:10.1f}{r['file_ms']:10.1f}{ratio:10.2f}")  # fmt: skip
    step = statistics.mean(
        sum(s.seconds.get(k, 0.0) for k in STAGES) for s in (run.steps[1:] or run.steps)
    )
    tiny_push = results[0]["push_ms"] / 1e3
    print(f"tiny push / mean step: {tiny_push / step:.1%}")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
