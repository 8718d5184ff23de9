"""The real ``trl.GRPOTrainer`` trains the tiny model through two ``tokcap-vllm serve`` gates.

This process is the trainer: Ray + TransferQueue (``tq_cluster``), the shared fleet's two
served gates that stage into it (``served_fleet``, tests/conftest.py: ``--tokcap-require-open``,
weight pushes over shared memory; never pushed to before this module), and TRL's own
``GRPOTrainer`` on CPU (``use_vllm=False``) with `tokcap_trl.GRPORollouts` as its
``rollout_func`` and its `WeightPushCallback`. The harness is `tokcap_trl.chat_harness`
(two turns, the environment's turn between them) asking vLLM for its own token ids on every
response (``return_token_ids``): those are the engine's ids, read independently of
tokcap's capture, and a hook on the trainer (``compute_loss``) records the batch TRL
actually trains on. One rollout per batch names a response the gate never served as its
witness: its receipt is poisoned (``witness_unmatched``) and TRL gets a dummy row.

One training run (module scope) answers every test: every receipt verified but the
poisoned ones; TRL's rows equal the engine's ids and loss mask; the weights pushed after
every step (every gate's version is TRL's step, every row was sampled by the weights of
its step); the reward rises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.e2e._fleet import SharedFleet
    from tokcap_trl import Episode, Scored

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.needs_an_unpushed_fleet]

STEPS = 10
PROMPTS = 4
GENERATIONS = 8
MAX_TOKENS = 8
LEARNING_RATE = 1e-2
TOP_K = 20
"""Sampling from the top 20 tokens gives a random tiny model a small vocabulary per
position, so each step samples each candidate many times: measured here with TRL's own
generation, the vowel share rose 0.32 -> 0.62 in 10 steps at this learning rate."""
POISONED_INDEX = 5
"""In every batch, the rollout at this index is scored with a witness no call matches."""
# Everything heavy (TRL, transformers, torch, tokcap's adapters) is imported inside the
# fixtures, after the session's Ray is up: with torch imported first, a local Ray on a
# loaded 2-core box missed its 30 s raylet start-up window every time tried here.


def score(answers: Sequence[str]) -> float:
    """The task: the share of the answers' non-space characters that are vowels."""
    chars = [c for c in "".join(answers) if not c.isspace()]
    return sum(c in "aeiou" for c in chars) / len(chars) if chars else 0.0


@dataclass
class Run:
    """What one training run saw, from each side."""

    engine: dict[str, list[tuple[list[int], list[int]]]] = field(default_factory=dict)
    """Per rollout id, each call's (prompt ids, output ids) as vLLM returned them."""
    scores: dict[str, float] = field(default_factory=dict)
    """Per rollout id, the reward the harness gave."""
    batches: list[dict[str, Any]] = field(default_factory=list)
    """What the rollout function returned, per batch."""
    collected: list[Any] = field(default_factory=list)
    """`tokcap_trl.CollectedBatch` per batch."""
    trained: list[tuple[int, list[tuple[list[int], list[int], list[int], float]]]] = field(
        default_factory=list
    )
    """Per ``compute_loss``: TRL's step and its rows (prompt, completion, mask, advantage)."""
    log: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pushed: list[int] = field(default_factory=list)
    global_step: int = 0
    pad_token_id: int = -1


@pytest.fixture(scope="module")
def gates(served_fleet: SharedFleet) -> tuple[list[str], str, Path]:
    """The shared fleet's two gates, never pushed to (TRL pushes its step as the version,
    from 0); their URLs, token and model."""
    return [g.url for g in served_fleet.unpushed()], served_fleet.token, served_fleet.model


def _rows_of(inputs: dict[str, Any]) -> list[tuple[list[int], list[int], list[int], float]]:
    """The rows of TRL's padded batch, unpadded: prompt, completion, env mask, advantage."""
    rows = []
    for i in range(inputs["prompt_ids"].shape[0]):
        keep = inputs["completion_mask"][i].bool()
        rows.append(
            (
                inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist(),
                inputs["completion_ids"][i][keep].tolist(),
                inputs["tool_mask"][i][keep].tolist(),
                float(inputs["advantages"][i]),
            )
        )
    return rows


@pytest.fixture(scope="module")
def run(
    gates: tuple[list[str], str, Path],
    served_fleet: SharedFleet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """Train ``STEPS`` steps with TRL's GRPOTrainer through the gates; what each side saw."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokcap_tq import TQSink
    from tokcap_trl import GRPORollouts, Scored, chat_harness, receipt_reward

    urls, token, model_dir = gates
    record = Run()

    def on_response(episode: Episode, response: Any) -> None:
        calls = record.engine.setdefault(episode.rollout_id, [])
        calls.append((list(response.prompt_token_ids), list(response.choices[0].token_ids)))

    def played(episode: Episode) -> Any:
        """The two-turn chat, its sampling seeded by the rollout's place in the run (batch
        and index; its id's random run token left out): the run is the same every time."""
        batch, index = episode.rollout_id.split("-")[-2:]
        return chat_harness(
            score,
            turns=2,
            reply="More, please.",
            max_tokens=MAX_TOKENS,
            extra_body={
                "return_token_ids": True,
                "top_k": TOP_K,
                "seed": int(batch[1:]) * 1000 + int(index),
            },
            on_response=on_response,
        )

    async def harness(client: Any, episode: Episode) -> Scored:
        scored = await played(episode)(client, episode)
        assert isinstance(scored, Scored)
        record.scores[episode.rollout_id] = scored.reward
        if episode.index == POISONED_INDEX:  # a witness naming no call of this rollout
            return Scored(reward=scored.reward, response_id="chatcmpl-never-served")
        return scored

    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl import GRPOConfig, GRPOTrainer

        class RecordingTrainer(GRPOTrainer):
            """TRL's trainer, recording every batch it computes its loss on."""

            def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
                record.trained.append((self.state.global_step, _rows_of(inputs)))
                return super().compute_loss(model, inputs, *args, **kwargs)

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        prompts = [f"Write a word about {topic}." for topic in ("cats", "rain", "ships", "tea")]
        dataset = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": p}]} for p in prompts * STEPS]
        )
        config = GRPOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl-out")),
            use_cpu=True,
            use_vllm=False,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            max_steps=STEPS,
            per_device_train_batch_size=PROMPTS * GENERATIONS,
            num_generations=GENERATIONS,
            max_completion_length=2 * MAX_TOKENS + 16,
            beta=0.0,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        sink = TQSink(served_fleet.sink)
        with GRPORollouts(
            urls, token=token, sink=sink, harness=harness, max_seq_len=1024
        ) as rollouts:

            def rollout_func(batch_prompts: list[Any], trainer: Any) -> dict[str, Any]:
                out = rollouts(batch_prompts, trainer)
                record.batches.append(out)
                record.collected.append(rollouts.last)
                return out

            trainer = RecordingTrainer(
                model=policy,
                reward_funcs=[receipt_reward],
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
                rollout_func=rollout_func,
                callbacks=[rollouts.callback],
            )
            record.pad_token_id = tokenizer.pad_token_id  # after TRL set it, if it had to
            trainer.train()
            record.versions = [info.version for info in rollouts.versions()]
            record.pushed = list(rollouts.callback.pushed)
            record.global_step = trainer.state.global_step
            record.log = list(trainer.state.log_history)
    return record


def test_every_rollout_has_a_verified_receipt_but_the_poisoned_one(run: Run) -> None:
    assert len(run.collected) == STEPS
    for batch in run.collected:
        assert len(batch.rollouts) == PROMPTS * GENERATIONS
        for c in batch.rollouts:
            if c.index == POISONED_INDEX:
                assert c.receipt.status == "poisoned"
                assert c.reason == "witness_unmatched"
                assert not c.valid
            else:
                assert c.receipt.status == "verified"
                assert c.valid
                assert c.reward == run.scores[c.rollout_id]  # the ledger's reward is the score
        assert batch.metrics["tokcap/receipts_verified"] == PROMPTS * GENERATIONS - 1
        assert batch.metrics["tokcap/invalid/witness_unmatched"] == 1
        assert len({c.gate_url for c in batch.rollouts}) == 2  # both gates played


def test_trl_trains_on_the_engines_ids_and_loss_mask(run: Run) -> None:
    assert [step for step, _ in run.trained] == list(range(STEPS))
    pad = run.pad_token_id
    for (_, trained), batch in zip(run.trained, run.collected, strict=True):
        expected = []
        for c in batch.rollouts:
            if not c.valid:
                expected.append(([pad], [pad], [0]))
                continue
            calls = run.engine[c.rollout_id]
            assert len(calls) == 2
            first_prompt = calls[0][0]
            last_prompt, last_output = calls[-1]
            ids = [*last_prompt, *last_output]
            mask = [0] * len(ids)
            for prompt, output in calls:
                assert ids[: len(prompt)] == prompt  # each call extends the one before
                mask[len(prompt) : len(prompt) + len(output)] = [1] * len(output)
            cut = len(first_prompt)
            expected.append((ids[:cut], ids[cut:], mask[cut:]))
        # TRL shuffles its batch: compare the rows as multisets
        assert sorted((p, c, m) for p, c, m, _ in trained) == sorted(expected)
        dummies = [(c, m, advantage) for _, c, m, advantage in trained if not any(m)]
        assert len(dummies) == 1
        assert dummies[0][2] == 0.0  # the dummy has no advantage and no loss token


def test_weights_are_pushed_after_every_step(run: Run) -> None:
    from tokcap_trl import REASON_KEY, VALID_KEY, WEIGHT_VERSION_KEY

    assert run.global_step == STEPS
    assert run.pushed == list(range(1, STEPS + 1))
    assert run.versions == [STEPS, STEPS]  # every gate serves TRL's last step
    for step, out in enumerate(run.batches):
        versions = {v for v, ok in zip(out[WEIGHT_VERSION_KEY], out[VALID_KEY], strict=True) if ok}
        assert versions == {step}  # the receipts say: sampled by the weights of this step
        assert [r for r in out[REASON_KEY] if r is not None] == ["witness_unmatched"]


def test_the_reward_rises(run: Run) -> None:
    rewards = [
        entry["rewards/receipt_reward/mean"]
        for entry in run.log
        if "rewards/receipt_reward/mean" in entry
    ]
    assert len(rewards) == STEPS
    # seeded (see the harness), the curve is the same every run: measured 0.30, 0.38, 0.37,
    # ..., 0.56, 0.62, 0.68 (first three 0.35, last three 0.62); unseeded runs had dipped
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards
