"""A group's rows as TRL ``RolloutSample``s (`tokcap_trl.group_samples`), no engine.

Valid rows keep their exact ids, loss mask and logprobs; the advantage is
`tokcap_core.grpo` over the valid rows only (a placeholder's reward moves nothing); the
version is TRL's number for the row's oldest weights; placeholders and rows sampled
before training began become no sample and are counted by reason.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tokcap_core import TrainingRow, grpo, placeholder_row
from tokcap_core.simulate import one_call_row
from tokcap_trl import group_samples


def _sample_type() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-import and vLLM-version notes
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        return RolloutSample


def _row(rollout_id: str, reward: float, version: int) -> TrainingRow:
    return one_call_row(
        rollout_id,
        prompt_ids=[5, 6],
        output_ids=[7, 8, 9],
        logprobs=[-0.5, -1.25, -2.0],
        weight_version=version,
        reward=reward,
    )


@pytest.mark.parametrize("poisoned_reward", [0.0, 1e9])
def test_valid_rows_become_samples_and_placeholders_are_counted(poisoned_reward: float) -> None:
    rows = [
        _row("r0", 1.0, 10),
        _row("r1", 0.0, 11),
        placeholder_row("r2", "witness_unmatched", reward=poisoned_reward),
        _row("r3", 0.5, 10),
        _row("r4", 2.0, 9),  # sampled before training began (base 10)
    ]
    made = group_samples(
        rows, group_id=7, base_version=10, prompt=[{"role": "user", "content": "hi"}],
        sample_type=_sample_type(),
    )  # fmt: skip
    assert made.left_out == {"witness_unmatched": 1, "sampled_before_training": 1}
    assert [s.model_version for s in made.samples] == [0, 1, 0]
    assert {s.group_id for s in made.samples} == {7}
    expected = grpo([1.0, 0.0, 0.0, 0.5, 2.0], [7] * 5, [True, True, False, True, True])
    assert [s.advantage for s in made.samples] == [expected[0], expected[1], expected[3]]
    assert made.rewards == [1.0, 0.0, 0.5]
    for sample in made.samples:
        assert sample.input_ids.tolist() == [5, 6, 7, 8, 9]
        assert sample.completion_mask.tolist() == [0, 0, 1, 1, 1]
        assert sample.old_log_probs.tolist() == [0.0, 0.0, -0.5, -1.25, -2.0]
        assert sample.prompt == [{"role": "user", "content": "hi"}]
