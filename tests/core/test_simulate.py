"""`one_call_row`: the row of a one-call rollout, laid out as reassembly lays out every row."""

from __future__ import annotations

import pytest

from tokcap_core.simulate import one_call_row


@pytest.mark.parametrize(("finish_reason", "truncated"), [("stop", False), ("length", True)])
def test_one_call_row_carries_the_prompt_and_learns_from_the_output(
    finish_reason: str, truncated: bool
) -> None:
    row = one_call_row(
        "r-1",
        prompt_ids=[5, 6],
        output_ids=[7, 8, 9],
        logprobs=[-0.5, -1.25, -2.0],
        weight_version=3,
        finish_reason=finish_reason,
        reward=0.5,
    )
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert row.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert row.logprobs.tolist() == [0.0, 0.0, -0.5, -1.25, -2.0]
    assert (row.prompt_len, row.weight_version_min, row.weight_version_max) == (2, 3, 3)
    assert (row.reward, row.sample_mask, row.reason, row.truncated) == (0.5, 1, None, truncated)
    (span,) = row.call_spans
    assert (span.start, span.carry_len, span.gen_len) == (0, 2, 3)
    assert row.terminal_call_id == span.call_id
