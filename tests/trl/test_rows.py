"""Collected rollouts in TRL's ``rollout_func`` shape, from real core objects (no engine).

A two-turn rollout is written to a real `tokcap_core.Ledger` the way a gate writes it
(admitted, staged, child admitted on the parent's exact ids, staged, closed with a
reward), its manifest verified into a receipt and its staged calls reassembled: the row
TRL gets must split at the first generated token, mask the environment's turn with
``env_mask`` 0, carry the engine's logprobs and the receipt's reward. A rollout whose
ledger poisons its receipt becomes a dummy row no loss term can reach.
"""

from __future__ import annotations

from typing import Any

import pytest

from tokcap_core import assemble_receipt, placeholder_row, reassemble, verify_manifest
from tokcap_core.ledger import Closed, Ledger, Witnesses, manifest_of
from tokcap_core.simulate import admit_call, stage_call
from tokcap_trl import (
    REASON_KEY,
    REWARD_KEY,
    VALID_KEY,
    WEIGHT_VERSION_KEY,
    Collected,
    receipt_reward,
    trl_rollout_output,
)

PROMPT = [11, 12, 13, 14]
FIRST = [21, 22, 23]
ENV = [31, 32]
SECOND = [41, 42]
LOGPROBS_1 = [-0.5, -0.25, -1.0]
LOGPROBS_2 = [-2.0, -0.125]
PAD = 0


def _two_turns(rollout_id: str, *, reward: float, version: int) -> Collected:
    """A verified two-turn rollout as a gate would record it, rebuilt as its row."""
    ledger = Ledger(rollout_id)
    c1 = admit_call(ledger, None, admitted_at=1, request_fingerprint="req-1")
    first = stage_call(
        ledger,
        c1,
        None,
        prompt_ids=PROMPT,
        output_ids=FIRST,
        logprobs=LOGPROBS_1,
        weight_version=version,
        response_id="resp-1",
    )
    c2 = admit_call(ledger, first, admitted_at=2, request_fingerprint="req-2")
    second = stage_call(
        ledger,
        c2,
        first,
        prompt_ids=[*PROMPT, *FIRST, *ENV],
        output_ids=SECOND,
        logprobs=LOGPROBS_2,
        weight_version=version,
        response_id="resp-2",
    )
    ledger.append(Closed(reward=reward, witnesses=Witnesses(response_id="resp-2")))
    receipt = assemble_receipt(verify_manifest(manifest_of(ledger)))
    assert receipt.ok
    (row,) = reassemble(receipt, [first, second], max_seq_len=1024)
    return Collected(
        rollout_id=rollout_id,
        group_id="g0",
        index=0,
        gate_url="http://127.0.0.1:1",
        row=row,
        receipt=receipt,
    )


def _poisoned(rollout_id: str) -> Collected:
    """A rollout whose only call was admitted and never staged: its receipt is poisoned
    (``uncommitted_call``) and the collector gives it a placeholder row."""
    ledger = Ledger(rollout_id)
    admit_call(ledger, None, admitted_at=1, request_fingerprint="req-1")
    ledger.append(Closed(reward=1.0))
    receipt = assemble_receipt(verify_manifest(manifest_of(ledger)))
    assert not receipt.ok
    assert receipt.failure_reason is not None
    return Collected(
        rollout_id=rollout_id,
        group_id="g0",
        index=1,
        gate_url="http://127.0.0.1:1",
        row=placeholder_row(rollout_id, receipt.failure_reason, reward=1.0),
        receipt=receipt,
    )


def test_a_verified_rollout_splits_at_its_first_generated_token() -> None:
    out = trl_rollout_output([_two_turns("r-0", reward=0.75, version=3)], pad_token_id=PAD)
    assert out["prompt_ids"] == [PROMPT]
    assert out["completion_ids"] == [[*FIRST, *ENV, *SECOND]]
    assert out["env_mask"] == [[1, 1, 1, 0, 0, 1, 1]]
    assert out["logprobs"] == [[*LOGPROBS_1, 0.0, 0.0, *LOGPROBS_2]]
    assert out[REWARD_KEY] == [0.75]
    assert out[VALID_KEY] == [True]
    assert out[REASON_KEY] == [None]
    assert out[WEIGHT_VERSION_KEY] == [3]


def test_a_poisoned_rollout_is_a_dummy_row_no_loss_reaches() -> None:
    batch = [_two_turns("r-0", reward=0.5, version=0), _poisoned("r-1")]
    out = trl_rollout_output(batch, pad_token_id=PAD)
    assert out["prompt_ids"][1] == [PAD]
    assert out["completion_ids"][1] == [PAD]
    assert out["env_mask"][1] == [0]
    assert out["logprobs"][1] == [0.0]
    assert out[VALID_KEY] == [True, False]
    assert out[REWARD_KEY] == [0.5, None]  # the harness's 1.0 never reaches TRL
    assert out[REASON_KEY][1] == "uncommitted_call"
    assert out[WEIGHT_VERSION_KEY][1] is None
    assert len({len(v) for v in out.values()}) == 1  # one row per rollout, every key


def test_the_reward_function_hands_trl_the_receipts_rewards() -> None:
    logged: list[tuple[str, float]] = []
    rewards = receipt_reward(
        prompts=["p", "p"],
        completions=["a", "b"],
        tokcap_reward=[0.25, None],
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert rewards == [0.25, None]
    assert logged == [("tokcap/valid_fraction", 0.5)]


@pytest.mark.parametrize("kwargs", [{}, {"log_metric": None}])
def test_the_reward_function_needs_no_logger(kwargs: dict[str, Any]) -> None:
    assert receipt_reward(tokcap_reward=[1.0], **kwargs) == [1.0]
