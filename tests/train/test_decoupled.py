"""Decoupled PPO on the tiny fp32 model: the proximal ratio, TIS weights, MIS masking, and
parity per staleness bucket."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.train.test_train import make_row, random_rows, with_engine_logprobs
from tokcap.train import TrainConfig, Trainer, policy_loss

pytestmark = pytest.mark.integration


def test_the_proximal_ratio_is_one_and_each_token_weighs_by_its_importance_weight() -> None:
    lp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    engine = torch.tensor([[0.0, -5.0, -5.0]])  # far from the trainer: the ratio would clip
    mask = torch.tensor([[False, True, True]])
    weights = torch.tensor([[0.0, 2.0, 0.0]])  # the second token MIS/TIS-weighted to nothing
    loss, stats = policy_loss(
        lp,
        engine,
        torch.tensor([1.0]),
        mask,
        proximal_logprobs_B_T=lp.detach(),
        behaviour_weights_B_T=weights,
    )
    loss.backward()
    assert lp.grad is not None
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -2.0 / 2, 0.0])
    assert (stats.clip_fraction, stats.ratio_max) == (0.0, 1.0)


def test_on_fresh_rows_every_weight_is_one_and_no_row_is_masked(model: Any) -> None:
    rows = with_engine_logprobs(model, random_rows(4, seed=5))
    config = TrainConfig(decoupled=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    report = trainer.step(rows, [1.0, -1.0, 0.5, -0.5])
    assert (report.is_weight_mean, report.rows_masked) == (1.0, 0)
    assert report.parity.k3 == 0.0


@pytest.mark.parametrize(
    ("shift", "masked", "weight"),
    [
        (-0.5, 0, math.exp(0.5)),  # engine less sure: weight e^0.5, inside the band
        (-1.0, 4, 1.0),  # ratio e^1 > 2: every row masked out (no kept token: mean 1.0)
        (0.25, 0, math.exp(-0.25)),
    ],
)
def test_stale_rows_get_truncated_weights_or_are_masked(
    model: Any, shift: float, masked: int, weight: float
) -> None:
    fresh = with_engine_logprobs(model, random_rows(4, seed=6))
    rows = [
        make_row(
            list(r.input_ids),
            r.prompt_len,
            logprobs=[v + shift for v in r.logprobs],
            version=0,
            name=r.rollout_id,
        )
        for r in fresh
    ]
    config = TrainConfig(decoupled=True, tis_cap=2.0, mis_band=(0.5, 2.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    report = trainer.step(rows, [1.0, -1.0, 0.5, -0.5])
    assert report.rows_masked == masked
    assert report.is_weight_mean == pytest.approx(weight, rel=1e-5)
    moved = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert moved == (masked < 4)  # every row masked: a zero gradient, the weights stay


def test_parity_is_reported_per_staleness_bucket(model: Any) -> None:
    rows = with_engine_logprobs(model, random_rows(4, seed=7))
    old = [
        make_row(list(r.input_ids), r.prompt_len, logprobs=list(r.logprobs), version=v, name=n)
        for r, v, n in zip(rows, (2, 2, 1, 0), ("a", "b", "c", "d"), strict=True)
    ]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), version=2)
    report = trainer.step(old, [1.0, -1.0, 1.0, -1.0])
    buckets = report.parity_by_staleness
    assert sorted(buckets) == [0, 1, 2]
    assert [buckets[s].tokens for s in (0, 1, 2)] == [
        old[0].num_generated + old[1].num_generated,
        old[2].num_generated,
        old[3].num_generated,
    ]
