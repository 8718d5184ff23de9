"""tokcap.train on the tiny fp32 model: collate, recompute, loss, a step with parity, staleness."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tokcap.train import (
    TrainConfig,
    Trainer,
    TrainInputError,
    collate,
    policy_loss,
    staleness,
    token_logprobs,
)
from tokcap_core import ConfigError, TrainingRow, placeholder_row
from tokcap_core.simulate import one_call_row

pytestmark = pytest.mark.integration


def make_row(
    ids: list[int],
    prompt_len: int,
    *,
    logprobs: list[float] | None = None,
    version: int = 0,
    name: str = "r",
) -> TrainingRow:
    """A valid one-call row (`tokcap_core.simulate.one_call_row`, made as a gate makes it):
    ``prompt_len`` carried tokens, the rest generated (``logprobs``: one per token, the
    carried ones ignored; zeros if not given)."""
    values = [0.0] * len(ids) if logprobs is None else logprobs
    return one_call_row(
        name,
        prompt_ids=ids[:prompt_len],
        output_ids=ids[prompt_len:],
        logprobs=values[prompt_len:],
        weight_version=version,
    )


def random_rows(count: int, *, seed: int, vocab: int = 2000) -> list[TrainingRow]:
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        n = int(torch.randint(6, 14, (), generator=rng))
        ids = torch.randint(0, vocab, (n,), generator=rng).tolist()
        rows.append(
            make_row(ids, prompt_len=int(torch.randint(2, 5, (), generator=rng)), name=f"r{i}")
        )
    return rows


def with_engine_logprobs(model: Any, rows: list[TrainingRow]) -> list[TrainingRow]:
    """The rows as if the engine held ``model``'s weights: each carries the model's own logprobs."""
    with torch.no_grad():
        lp = token_logprobs(model, collate(rows))
    return [
        make_row(
            list(r.input_ids),
            r.prompt_len,
            logprobs=lp[i, : len(r.input_ids)].tolist(),
            version=r.weight_version_min or 0,
            name=r.rollout_id,
        )
        for i, r in enumerate(rows)
    ]


# ---- collate -------------------------------------------------------------------------------


def test_collate_pads_right_and_copies_each_buffer_into_its_row() -> None:
    long_id = 4_000_000_000  # u32 ids survive as they are
    rows = [
        make_row([5, 6, 7, long_id], 2, logprobs=[0, 0, -1.5, -2.5]),
        make_row([9, 8], 1, logprobs=[0, -0.25]),
        placeholder_row("gone", "stage_failed:x"),
    ]
    batch = collate(rows, pad_token_id=3)
    assert batch.input_ids_B_T.tolist() == [[5, 6, 7, long_id], [9, 8, 3, 3], [0, 3, 3, 3]]
    assert batch.attention_mask_B_T.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert batch.loss_mask_B_T.tolist() == [
        [False, False, True, True],
        [False, True, False, False],
        [False, False, False, False],
    ]
    assert batch.engine_logprobs_B_T.tolist() == [
        [0, 0, -1.5, -2.5],
        [0, -0.25, 0, 0],
        [0, 0, 0, 0],
    ]
    assert batch.sample_mask_B.tolist() == [True, True, False]
    assert batch.tokens == 3
    assert batch.input_ids_B_T.dtype == torch.int64


def test_collate_leaves_the_rows_untouched() -> None:
    row = make_row([1, 2, 3], 1, logprobs=[0, -1, -2])
    before = bytes(row.input_ids), bytes(row.loss_mask), bytes(row.logprobs)
    batch = collate([row])
    batch.input_ids_B_T.fill_(0)
    batch.engine_logprobs_B_T.fill_(7)
    assert (bytes(row.input_ids), bytes(row.loss_mask), bytes(row.logprobs)) == before


def test_collate_refuses_no_rows() -> None:
    with pytest.raises(TrainInputError) as info:
        collate([])
    assert info.value.code == "no_rows"


# ---- recompute -----------------------------------------------------------------------------


def test_token_logprobs_match_an_unpadded_per_row_softmax(model: Any) -> None:
    rows = random_rows(4, seed=1)
    with torch.no_grad():
        padded = token_logprobs(model, collate(rows))
        for i, row in enumerate(rows):
            ids = torch.tensor([list(row.input_ids)])
            logits = model(input_ids=ids).logits[0].double()
            expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            n = len(row.input_ids)
            assert padded[i, 0] == 0.0
            assert torch.allclose(padded[i, 1:n].double(), expected, atol=1e-5)


def test_token_logprobs_divide_the_logits_by_the_temperature(model: Any) -> None:
    rows = random_rows(2, seed=2)
    batch = collate(rows)
    with torch.no_grad():
        hot = token_logprobs(model, batch, temperature=0.5)
        logits = model(input_ids=batch.input_ids_B_T).logits[:, :-1] / 0.5
        manual = torch.log_softmax(logits, -1).gather(-1, batch.input_ids_B_T[:, 1:, None])[..., 0]
        cold = token_logprobs(model, batch)
    real = batch.attention_mask_B_T[:, 1:].bool()
    assert torch.allclose(hot[:, 1:][real], manual[real], atol=1e-6)
    assert not torch.allclose(hot[:, 1:][real], cold[:, 1:][real], atol=1e-3)


# ---- loss ----------------------------------------------------------------------------------


def test_at_ratio_one_the_loss_is_minus_the_token_mean_advantage() -> None:
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True], [False, True, False]])
    loss, stats = policy_loss(lp, lp.detach(), torch.tensor([1.0, -2.0]), mask)
    assert loss.item() == pytest.approx(-(1.0 + 1.0 - 2.0) / 3)
    assert stats.tokens == 3
    assert stats.clip_fraction == 0.0
    assert stats.ratio_max == 1.0
    loss.backward()
    assert lp.grad is not None
    # a positive advantage pushes its tokens' logprobs up, a negative one down, masked: nothing
    assert lp.grad.flatten().tolist() == pytest.approx([0, -1 / 3, -1 / 3, 0, 2 / 3, 0])


def test_a_clipped_token_gets_no_gradient_and_is_counted() -> None:
    engine = torch.tensor([[-1.0, -1.0]])
    lp = (engine + torch.tensor([[0.5, 0.0]])).requires_grad_()  # ratio e^0.5 ~ 1.65 > 1.2
    loss, stats = policy_loss(lp, engine, torch.tensor([1.0]), torch.tensor([[True, True]]))
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 0] == 0.0
    assert lp.grad[0, 1] != 0.0
    assert stats.clip_fraction == 0.5
    assert stats.ratio_max == pytest.approx(math.exp(0.5))


def test_clip_high_widens_only_the_upper_side() -> None:
    engine = torch.tensor([[-1.0, -1.0]])
    shift = torch.tensor([[0.2, -0.3]])  # ratios ~1.22 (advantage +1) and ~0.74 (advantage -1)

    def grads(**clip: float) -> list[float]:
        lp = (engine + shift).requires_grad_()
        mask = torch.tensor([[True, True]])
        loss, _ = policy_loss(lp[:, :1], engine[:, :1], torch.tensor([1.0]), mask[:, :1], **clip)
        low, _ = policy_loss(lp[:, 1:], engine[:, 1:], torch.tensor([-1.0]), mask[:, 1:], **clip)
        (loss + low).backward()
        assert lp.grad is not None
        return lp.grad[0].tolist()

    assert grads() == [0.0, 0.0]  # both clipped at 1 +- 0.2
    up, down = grads(clip_high=0.28)
    assert up != 0.0  # 1.22 is inside the wider upper bound
    assert down == 0.0  # the lower bound did not move


def test_values_outside_the_mask_never_reach_the_loss() -> None:
    lp = torch.tensor([[math.nan, -1.0]], requires_grad=True)
    engine = torch.tensor([[math.inf, -1.0]])
    loss, _ = policy_loss(lp, engine, torch.tensor([2.0]), torch.tensor([[False, True]]))
    loss.backward()
    assert loss.item() == -2.0
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all()


# ---- a step --------------------------------------------------------------------------------


def test_a_step_reports_exact_parity_on_its_own_logprobs_then_moves_the_policy(model: Any) -> None:
    rows = with_engine_logprobs(model, random_rows(6, seed=3))
    rows.append(placeholder_row("gone", "stage_failed:x"))
    advantages = [1.0, -1.0, 1.0, -1.0, 0.5, -0.5, 0.0]
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), version=0)
    report = trainer.step(rows, advantages)
    assert report.parity.tokens == sum(r.num_generated for r in rows)
    assert report.parity.k3 == 0.0
    assert report.parity.max_abs == 0.0
    assert (report.version, trainer.version, report.staleness_max) == (1, 1, 0)
    assert (report.rows_valid, report.rows_placeholder) == (6, 1)
    assert report.grad_norm is not None
    assert report.grad_norm > 0
    assert report.ratio_max == 1.0
    assert report.clip_fraction == 0.0

    with torch.no_grad():
        after = token_logprobs(model, collate(rows))
    batch = collate(rows)
    before = batch.engine_logprobs_B_T
    moved = [float(((after - before) * batch.loss_mask_B_T)[i].sum()) for i in range(6)]
    assert all(m > 0 for m in moved[0:6:2]), moved  # positive advantage: more likely
    assert all(m < 0 for m in moved[1:6:2]), moved  # negative advantage: less likely
    second = trainer.step(rows, advantages)
    assert second.parity.k3 > 1e-9  # the engine still holds the old weights
    assert second.staleness_max == 1


def test_a_batch_of_placeholders_takes_no_step(model: Any) -> None:
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), version=4)
    before = {k: v.clone() for k, v in trainer.weights().items()}
    report = trainer.step([placeholder_row("a", "stage_failed:x")], [0.0])
    assert (report.version, report.grad_norm, report.tokens, report.staleness_max) == (
        4,
        None,
        0,
        None,
    )
    assert all(torch.equal(before[k], v) for k, v in trainer.weights().items())


def test_weights_are_the_full_state_dict_with_the_tied_head(model: Any) -> None:
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    weights = trainer.weights()
    assert "lm_head.weight" in weights
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    assert not any(t.requires_grad for t in weights.values())


def test_staleness_is_the_trainer_version_minus_the_oldest_sampling_version() -> None:
    rows = [
        make_row([1, 2], 1, version=3),
        make_row([1, 2], 1, version=5),
        placeholder_row("x", "stage_failed:y"),
    ]
    assert staleness(rows, 5) == 2
    assert staleness(rows[2:], 5) is None


def test_bad_step_input_is_refused(model: Any) -> None:
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rows = random_rows(2, seed=4)
    with pytest.raises(TrainInputError) as info:
        trainer.step(rows, [1.0])
    assert info.value.code == "advantages_mismatch"
    with pytest.raises(TrainInputError) as info:
        trainer.step(rows, [1.0, math.nan])
    assert info.value.code == "non_finite_advantage"
    assert trainer.version == 0


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"temperature": 0.0}, "bad_temperature"),
        ({"clip_low": 1.0}, "bad_clip_low"),
        ({"clip_low": -0.1}, "bad_clip_low"),
        ({"clip_high": math.inf}, "bad_clip_high"),
        ({"max_grad_norm": math.nan}, "bad_max_grad_norm"),
    ],
)
def test_bad_config_is_a_config_error(kwargs: dict[str, float], code: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)
    assert info.value.code == code
