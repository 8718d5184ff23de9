"""TRL's real ``AsyncGRPOTrainer`` trains through served gates (issue #34, the async half).

Real parts throughout: two ``tokcap-vllm serve`` gates (OS processes, CPU engines on the
tiny Qwen3: the shared fleet's, ``served_fleet`` in tests/conftest.py) staging into
TransferQueue on the session's local Ray (``tq_cluster``); the
``openai`` client over HTTP in the harness; TRL 1.16's own ``AsyncGRPOTrainer`` with
`tokcap_trl.AsyncGRPOGates` as its ``rollout_worker`` and ``weight_transfer``. The only
replacements are the two CUDA-only spots of TRL's trainer (tests/trl/_async_cpu.py).

What is checked: every receipt verified but one per group, whose harness names a witness
no call matches (poisoned ``witness_unmatched``: counted, never in TRL's buffer); every
sample TRL consumed is exactly an engine sequence (ids, loss mask = the engine's
generated positions, ``old_log_probs`` = the engine's logprobs); the gates' version
advances once per TRL weight sync (the cold one included) and TRL's ``model_version``
maps onto it; the first step's trainer/engine KL is at fp32 noise (the pushed weights,
tied head added, are the trainer's); every parameter moved. Then the failures: a push
the gates refuse raises and holds the fleet until a full push; a worker whose rollouts
fail, stall or never started makes ``check_health`` raise.
"""

from __future__ import annotations

import queue
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._fleet import SharedFleet
from tests.trl._async_cpu import CpuVarlenAttention, cpu_async_grpo
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_trl import AsyncGRPOGates, Episode, Scored, TRLAdapterError, chat_harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUP = 4
STEPS = 3
POISONED_INDEX = 3
"""In every group, the rollout at this index names a witness no call matches."""
PROMPTS = ["Count to five:", "Name a number:", "Say 7 7 7", "Digits please:"]


def _import_trl() -> Any:
    """TRL's experimental package warns when imported (and about vLLM 0.32): expected here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental import async_grpo

        return async_grpo


@pytest.fixture(scope="module")
def model_dir(served_fleet: SharedFleet) -> Path:
    """The tiny model the gates serve (and TRL trains)."""
    return served_fleet.model


@pytest.fixture(scope="module")
def gates(served_fleet: SharedFleet) -> tuple[list[str], str]:
    """The shared fleet's two gates on the session's Ray + TransferQueue (ids returned to
    harnesses, weight pushes from this process), at whatever version they serve; their URLs
    and control token."""
    return [g.url for g in served_fleet.up()], served_fleet.token


class TakenQueue(queue.Queue[Any]):
    """The worker's buffer, remembering every sample TRL took from it."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: list[Any] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        self.taken.append(item)
        return item


class EngineRecord:
    """What the engine returned to the harness, per rollout: the full ids of its last call,
    which positions were generated, and their logprobs."""

    def __init__(self) -> None:
        self.by_rollout: dict[str, tuple[list[int], dict[int, float]]] = {}

    def __call__(self, episode: Episode, response: Any) -> None:
        prompt = list(response.prompt_token_ids)
        generated = list(response.choices[0].token_ids)
        logprobs = [t.logprob for t in response.choices[0].logprobs.content]
        assert len(logprobs) == len(generated)
        _, before = self.by_rollout.get(episode.rollout_id, ([], {}))
        spans = dict(before)
        spans.update({len(prompt) + i: lp for i, lp in enumerate(logprobs)})
        self.by_rollout[episode.rollout_id] = (prompt + generated, spans)

    def match(self, sample: Any, *, leaving_out: set[str]) -> bool:
        """Whether ``sample`` is exactly the engine sequence, mask and logprobs of a rollout
        not in ``leaving_out``."""
        ids = sample.input_ids.tolist()
        for rollout_id, (engine_ids, generated) in self.by_rollout.items():
            if rollout_id in leaving_out or engine_ids != ids:
                continue
            mask = [int(p in generated) for p in range(len(ids))]
            logprobs = torch.tensor([generated.get(p, 0.0) for p in range(len(ids))])
            if sample.completion_mask.tolist() == mask and torch.allclose(
                sample.old_log_probs, logprobs, atol=1e-6, rtol=0
            ):
                return True
        return False


def _digits(answers: Any) -> float:
    return float(sum(ch.isdigit() for answer in answers for ch in answer))


def _adapter(
    gates: tuple[list[str], str], model_dir: Path, harness: Any, **options: Any
) -> AsyncGRPOGates:
    urls, token = gates
    return AsyncGRPOGates(
        urls,
        token,
        TQSink(TQSinkConfig()),
        harness,
        PROMPTS,
        model=str(model_dir),
        group_size=GROUP,
        max_seq_len=1024,
        **options,
    )


def test_async_grpo_trainer_trains_on_the_engines_tokens_through_gates(
    gates: tuple[list[str], str], model_dir: Path, tmp_path: Path
) -> None:
    import transformers
    from datasets import Dataset

    async_grpo = _import_trl()
    engine = EngineRecord()
    played = chat_harness(
        _digits,
        turns=2,
        reply="More digits.",
        max_tokens=12,
        extra_body={"return_token_ids": True, "logprobs": True},
        on_response=engine,
    )
    poisoned: set[str] = set()

    async def harness(client: Any, episode: Episode) -> Scored:
        scored = await played(client, episode)
        assert isinstance(scored, Scored)
        if episode.index != POISONED_INDEX:
            return scored
        poisoned.add(episode.rollout_id)  # a witness no call matches: the receipt is poisoned
        return Scored(reward=scored.reward, response_id="chatcmpl-never-served")

    taken = TakenQueue()
    args = async_grpo.AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        dtype="float32",
        max_steps=STEPS,
        per_device_train_batch_size=2 * GROUP,
        num_generations=GROUP,
        token_budget=0,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with cpu_async_grpo(), _adapter(gates, model_dir, harness, rollout_buffer=taken) as adapter:
        trainer = async_grpo.AsyncGRPOTrainer(
            model=str(model_dir),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=tokenizer,
            rollout_worker=adapter.rollout_worker,
            weight_transfer=adapter.weight_transfer,
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        calls_before = CpuVarlenAttention.calls
        trainer.train()
        transfer, worker = adapter.weight_transfer, adapter.rollout_worker
        base = transfer.versions.base
        assert adapter.weights is not None
        infos = adapter.call(adapter.weights.infos)
        run_id = adapter.run_id

    # TRL's stop cancelled the players mid-group: whatever they had opened, closed or not,
    # was released (an open cut short included), so the gates hold nothing of this run
    urls, token = gates
    assert [rid for rid in _rollouts_held(urls, token) if rid.startswith(run_id)] == []
    # one push per TRL sync (the cold one at train begin, then one per step), in order
    assert trainer.model_version == STEPS + 1
    assert transfer.pushes == [base + v for v in range(1, STEPS + 2)]
    assert {(i.phase, i.version, i.held) for i in infos} == {("READY", base + STEPS + 1, None)}
    # every rollout's receipt verified but the poisoned ones, which never reached TRL
    rollouts = worker.counts["tokcap/rollouts"]
    assert rollouts == worker.groups * GROUP
    assert worker.counts["tokcap/receipts_verified"] == rollouts - worker.groups > 0
    assert worker.left_out == {"witness_unmatched": worker.groups}
    assert len(poisoned) >= worker.groups  # a group stopped mid-way is not counted
    # what TRL trained on is exactly what the engine saw and produced
    assert len(taken.taken) >= STEPS * 2 * GROUP
    # (a valid rollout may have sampled the very sequence a poisoned one did: each valid
    # rollout gives one sample, so no sequence is taken more often than valid rollouts made it)
    unmatched = [s for s in taken.taken if not engine.match(s, leaving_out=poisoned)]
    assert unmatched == []
    made = Counter(tuple(ids) for r, (ids, _) in engine.by_rollout.items() if r not in poisoned)
    trained = Counter(tuple(s.input_ids.tolist()) for s in taken.taken)
    assert [ids for ids, n in trained.items() if n > made[ids]] == []
    versions = {s.model_version for s in taken.taken}
    assert versions <= set(range(1, STEPS + 2)), versions
    assert max(versions) > 1, versions
    assert all(s.completion_mask.sum() > 0 for s in taken.taken)
    # the pushed weights are the trainer's (tied head included): step 1 at fp32 noise
    first = next(log for log in trainer.state.log_history if "kl" in log)
    assert abs(first["kl"]) < 1e-4, first
    assert abs(first["ratio"] - 1.0) < 1e-3, first
    assert CpuVarlenAttention.calls > calls_before
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert sorted(moved) == sorted(before)


def test_a_push_the_gates_refuse_raises_and_holds_the_fleet_until_a_full_one(
    gates: tuple[list[str], str], model_dir: Path
) -> None:
    import transformers

    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    streamed = [(n, p.detach()) for n, p in policy.named_parameters()]  # TRL's stream: no head
    assert "lm_head.weight" not in dict(streamed)
    harness = chat_harness(_digits)
    with _adapter(gates, model_dir, harness) as adapter:
        assert adapter.weights is not None
        transfer = adapter.weight_transfer
        transfer.init_weight_transfer()
        base = transfer.versions.base
        with pytest.raises(TRLAdapterError) as refused:
            transfer.send_weights(iter(streamed[:-1]))  # one tensor short: a partial push
        assert refused.value.code == "weight_push_failed"
        assert "missing_tensors" in str(refused.value)
        assert transfer.versions.current == 0
        assert transfer.pushes == []
        assert adapter.call(adapter.weights.current_version) is None  # held, every gate
        transfer.send_weights(iter(streamed))  # the whole stream; the tied head is added
        transfer.resume()
        assert transfer.pushes == [base + 1]
        assert adapter.call(adapter.weights.current_version) == base + 1


def test_check_health_raises_when_rollouts_never_started_stall_or_fail(
    gates: tuple[list[str], str], model_dir: Path
) -> None:
    import time

    import anyio

    async def stuck(client: Any, episode: Episode) -> float:
        await anyio.sleep_forever()
        return 0.0

    with _adapter(gates, model_dir, stuck) as adapter:
        worker = adapter.rollout_worker
        with pytest.raises(TRLAdapterError) as never:
            worker.check_health(60.0)
        assert never.value.code == "rollouts_stopped"
        adapter.weight_transfer.init_weight_transfer()
        worker.start()
        time.sleep(1.0)
        with pytest.raises(TRLAdapterError) as stalled:
            worker.check_health(0.5)
        assert stalled.value.code == "rollouts_stalled"
        worker.check_health(600.0)  # still playing, only slow
        run_id = adapter.run_id
    # stopping cancelled the stuck harnesses; their rollouts were closed and released
    urls, token = gates
    assert [rid for rid in _rollouts_held(urls, token) if rid.startswith(run_id)] == []

    dead = AsyncGRPOGates(
        ["http://127.0.0.1:9"],
        token,
        TQSink(TQSinkConfig()),
        chat_harness(_digits),
        PROMPTS,
        model=str(model_dir),
        group_size=GROUP,
        max_seq_len=1024,
    )
    with dead as adapter:
        worker = adapter.rollout_worker
        worker.start()
        while worker.running:  # its first group fails at once: nobody listens on port 9
            time.sleep(0.1)
        with pytest.raises(TRLAdapterError) as failed:
            worker.check_health(600.0)
        assert failed.value.code == "rollouts_failed"
        assert failed.value.__cause__ is not None


def _rollouts_held(urls: list[str], token: str) -> list[str]:
    import anyio

    from tokcap_vllm import ControlPlaneClient

    async def held() -> list[str]:
        out: list[str] = []
        for url in urls:
            async with ControlPlaneClient(url, token) as client:
                out += [item.rollout_id for item in await client.rollouts()]
        return out

    return anyio.run(held)
