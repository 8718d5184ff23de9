"""Reassembly: a verified receipt and its staged calls become one training row per segment.

Laws: the row is the concatenation of the segment's call tokens; ``loss_mask`` is 1 exactly
on generated tokens; ``logprobs`` is the staged logprob there and exactly 0.0 elsewhere;
routes have one row per token, each parent's last generated token backfilled from its
child's prefill row; rows longer than ``max_seq_len`` are cut, tokens and routes alike;
any mismatch with the receipt raises `ReassemblyError` with the verification code.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap_core import (
    Ledger,
    ReassemblyError,
    Receipt,
    StagedCall,
    TrainingRow,
    VerificationError,
    assemble_receipt,
    placeholder_row,
    reassemble,
)
from tokcap_core.errors import InvalidStagedCall
from tokcap_core.ledger import Closed, TerminalDeclared
from tokcap_core.provenance import VersionSpan, single_span
from tokcap_core.routes import Routes, routes_from_rows, unknown_rows
from tokcap_core.simulate import SimulatedRollout, admit_call, simulate_rollout, stage_call
from tokcap_core.testing import simulated_rollouts

from ._versions import shifted

BIG = 1 << 20
LAYERS, TOPK = 2, 2


# ---- helpers ----------------------------------------------------------------------------


def _receipt(rollout: SimulatedRollout, segments: Any = "terminal") -> Receipt:
    receipt = assemble_receipt(rollout.ledger.state, segments=segments)
    assert receipt.ok, receipt.failure_reason
    return receipt


def _segment_calls(receipt: Receipt, staged: dict[str, StagedCall], index: int) -> list[StagedCall]:
    return [staged[link.staging_key] for link in receipt.segments[index]]


def _engine_routes(
    rows: int,
    expert: int,
    *,
    dtype: str = "int8",
    layers: int = LAYERS,
    topk: int = TOPK,
) -> Routes:
    """Engine-shaped routes: one ``[layers][topk]`` row per token it ran, all ``expert``."""
    return routes_from_rows(
        [[[expert] * topk for _ in range(layers)] for _ in range(rows)], dtype=dtype
    )


@dataclasses.dataclass
class Turn:
    """One model call of a hand-built chain: the new prompt tokens and the generated ones."""

    carry: Sequence[int]
    output: Sequence[int]
    routes: Any = (
        "engine"  # "engine": engine-shaped routes naming expert = turn index; None: no routes
    )
    dtype: str = "int8"
    layers: int = LAYERS
    finish_reason: str = "stop"
    weight_version: int = 0
    weight_version_last: int | None = None
    """The version at the last generated token (None: no weight push during the call)."""


def _spans(turn: Turn) -> tuple[VersionSpan, ...] | None:
    """Two spans, the last token on ``weight_version_last``, for a turn a push interrupted."""
    last = turn.weight_version_last
    if last is None or last == turn.weight_version:
        return None
    cut = len(turn.output) - 1
    return (
        VersionSpan(version=turn.weight_version, start=0, end=cut),
        VersionSpan(version=last, start=cut, end=len(turn.output)),
    )


def _chain(
    turns: Sequence[Turn], *, rollout_id: str = "run-1", reward: float | None = 1.0
) -> tuple[Receipt, dict[str, StagedCall]]:
    """A single-chain rollout as a gate would record it: ledger → receipt, plus its staged calls."""
    ledger = Ledger(rollout_id)
    staged: dict[str, StagedCall] = {}
    parent: StagedCall | None = None
    history: list[int] = []
    for index, turn in enumerate(turns):
        call_id = admit_call(ledger, parent, admitted_at=index, request_fingerprint=f"req-{index}")
        prompt = history + list(turn.carry)
        routes = turn.routes
        if routes == "engine":
            routes = _engine_routes(
                len(prompt) + len(turn.output) - 1, index, dtype=turn.dtype, layers=turn.layers
            )
        call = stage_call(
            ledger,
            call_id,
            parent,
            prompt_ids=prompt,
            output_ids=turn.output,
            logprobs=[-0.25 * (i + 1) for i in range(len(turn.output))],
            finish_reason=turn.finish_reason,
            weight_version=turn.weight_version,
            weight_versions=_spans(turn),
            routes=routes,
        )
        staged[call.key] = call
        history = prompt + list(turn.output)
        parent = call
    assert parent is not None
    ledger.append(TerminalDeclared(by="call_id", value=parent.call_id))
    ledger.append(Closed(reward=reward))
    return assemble_receipt(ledger.state), staged


THREE_TURNS = (
    Turn(carry=[10, 11, 12], output=[20, 21], weight_version=3),
    Turn(carry=[13, 14], output=[22, 23, 24], weight_version=4),
    Turn(carry=[15], output=[25], weight_version=5),
)


def _expected_mask(row: TrainingRow) -> list[int]:
    mask: list[int] = []
    for span in row.call_spans:
        mask += [0] * span.carry_len + [1] * span.gen_len
    return mask


def _check_row_laws(row: TrainingRow, calls: list[StagedCall]) -> None:
    """Every law a full (uncut) row obeys against the calls of its segment."""
    assert row.sample_mask == 1
    assert row.reason is None
    assert row.reason_bucket is None
    assert list(row.input_ids) == [t for c in calls for t in c.tokens]
    assert len(row.input_ids) == calls[-1].cum_len
    assert row.prompt_len == calls[0].carry_len
    assert [s.call_id for s in row.call_spans] == [c.call_id for c in calls]
    position = 0
    for span, call in zip(row.call_spans, calls, strict=True):
        assert span.start == position == call.prefix_len
        generated = slice(span.start + span.carry_len, span.start + span.carry_len + span.gen_len)
        carried = slice(span.start, generated.start)
        assert set(row.loss_mask[carried]) <= {0}
        assert list(row.loss_mask[generated]) == [1] * call.gen_len
        assert set(row.logprobs[carried]) <= {0.0}
        assert row.logprobs[generated] == call.logprobs  # both array('f'): exact f32 equality
        assert row.input_ids[generated] == call.tokens[call.carry_len :]
        position = generated.stop
    assert position == len(row.input_ids)
    assert list(row.loss_mask) == _expected_mask(row)
    assert row.num_generated == sum(c.gen_len for c in calls)
    assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m == 0)
    versions = [v for c in calls for v in (c.weight_version, c.weight_version_last)]
    assert (row.weight_version_min, row.weight_version_max) == (min(versions), max(versions))
    assert [(s.weight_version, s.weight_version_last) for s in row.call_spans] == [
        (c.weight_version, c.weight_version_last) for c in calls
    ]
    assert row.truncated == (calls[-1].finish_reason == "length")
    if calls[0].routes is None:
        assert row.routes is None
        assert row.backfilled_route_rows == 0
    else:
        assert row.routes is not None
        assert row.routes.shape[0] == len(row.input_ids)


# ---- the row is the segment ---------------------------------------------------------------


def test_row_concatenates_the_calls_of_the_terminal_chain() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert list(row.input_ids) == [10, 11, 12, 20, 21, 13, 14, 22, 23, 24, 15, 25]
    assert list(row.loss_mask) == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert list(row.logprobs) == [0, 0, 0, -0.25, -0.5, 0, 0, -0.25, -0.5, -0.75, 0, -0.25]
    assert row.prompt_len == 3
    assert (row.weight_version_min, row.weight_version_max) == (3, 5)
    assert row.terminal_call_id == receipt.terminal_call_id == "c000003"
    assert row.key == "run-1/s000"
    assert row.reward == 1.0
    assert not row.truncated
    _check_row_laws(row, list(staged.values()))


def test_a_call_generated_across_a_weight_push_widens_the_rows_versions() -> None:
    pushed = dataclasses.replace(
        THREE_TURNS[2], output=[25, 26], weight_version=5, weight_version_last=7
    )
    receipt, staged = _chain((*THREE_TURNS[:2], pushed))
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert (row.weight_version_min, row.weight_version_max) == (3, 7)
    assert (row.call_spans[2].weight_version, row.call_spans[2].weight_version_last) == (5, 7)
    assert receipt.segments[0][2].weight_version_last == 7
    # cut before the spanning call: only the versions of the generated tokens kept count
    (cut,) = reassemble(receipt, staged, max_seq_len=10)
    assert (cut.weight_version_min, cut.weight_version_max) == (3, 4)


def test_staged_calls_may_be_an_iterable_with_extra_calls() -> None:
    receipt, staged = _chain(THREE_TURNS)
    _, stray = _chain(THREE_TURNS[:1], rollout_id="other")
    rows = reassemble(receipt, [*stray.values(), *reversed(staged.values())], max_seq_len=BIG)
    assert rows == reassemble(receipt, staged, max_seq_len=BIG)


def test_reward_overrides_the_receipts_reward() -> None:
    receipt, staged = _chain(THREE_TURNS, reward=0.5)
    assert reassemble(receipt, staged, max_seq_len=BIG)[0].reward == 0.5
    assert reassemble(receipt, staged, max_seq_len=BIG, reward=-2.0)[0].reward == -2.0
    receipt, staged = _chain(THREE_TURNS, reward=None)
    assert reassemble(receipt, staged, max_seq_len=BIG)[0].reward is None


@settings(max_examples=60, deadline=None)
@given(rollout=simulated_rollouts())
def test_rows_obey_the_laws_for_simulated_rollouts(rollout: SimulatedRollout) -> None:
    receipt = _receipt(rollout)
    rows = reassemble(receipt, rollout.staged, max_seq_len=BIG)
    (row,) = rows
    calls = _segment_calls(receipt, rollout.staged, 0)
    _check_row_laws(row, calls)
    assert len(row.input_ids) == rollout.staged[receipt.segments[0][-1].staging_key].cum_len
    assert row.terminal_call_id == receipt.terminal_call_id == calls[-1].call_id
    assert row.reward == receipt.reward


@settings(max_examples=40, deadline=None)
@given(rollout=simulated_rollouts(max_roots=4))
def test_segments_all_gives_one_row_per_segment(rollout: SimulatedRollout) -> None:
    receipt = _receipt(rollout, segments="all")
    rows = reassemble(receipt, rollout.staged, max_seq_len=BIG)
    roots = {c.call_id for c in rollout.calls if c.parent_id is None}
    assert len(rows) == len(receipt.segments) == len(roots)
    assert [r.segment for r in rows] == list(range(len(rows)))
    assert len({r.key for r in rows}) == len(rows)
    for index, row in enumerate(rows):
        _check_row_laws(row, _segment_calls(receipt, rollout.staged, index))
        assert row.terminal_call_id == (receipt.terminal_call_id if index == 0 else None)
        assert row.reward == receipt.reward


# ---- PRIOR_ART: masks -------------------------------------------------------------------


def test_first_answer_token_is_not_dropped() -> None:
    """OpenRLHF #973: the first generated token of every call is trained (mask 1)."""
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    for span in row.call_spans:
        first = span.start + span.carry_len
        assert row.loss_mask[first] == 1
        assert row.input_ids[first] == staged[f"run-1/{span.call_id}"].generated[0]


def test_no_off_by_one_in_loss_masks() -> None:
    """verl #3287: the last carried token is 0, the token after it 1, the last generated 1."""
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    for span in row.call_spans:
        last_carried = span.start + span.carry_len - 1
        assert row.loss_mask[last_carried] == 0
        assert row.loss_mask[last_carried + 1] == 1
        assert row.loss_mask[span.start + span.carry_len + span.gen_len - 1] == 1


@settings(max_examples=40, deadline=None)
@given(rollout=simulated_rollouts())
def test_no_zeros_inside_masks(rollout: SimulatedRollout) -> None:
    """TRL #4974: within each call the 1s of the mask are one contiguous run: its generated span."""
    (row,) = reassemble(_receipt(rollout), rollout.staged, max_seq_len=BIG)
    for span in row.call_spans:
        mask = bytes(row.loss_mask[span.start : span.start + span.carry_len + span.gen_len])
        assert mask == bytes(span.carry_len) + b"\x01" * span.gen_len


def test_carried_tool_tokens_are_never_trained_even_if_they_equal_generated_ids() -> None:
    """Masks follow custody (which call produced a token), not token values."""
    receipt, staged = _chain([Turn(carry=[7, 7], output=[7]), Turn(carry=[7, 7, 7], output=[7, 7])])
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert list(row.input_ids) == [7] * 8
    assert list(row.loss_mask) == [0, 0, 1, 0, 0, 0, 1, 1]


# ---- truncation ---------------------------------------------------------------------------


def test_terminal_finish_length_marks_the_row_truncated() -> None:
    """verifiers #1005: a terminal that stopped on length is truncated, not a clean stop."""
    turns = [*THREE_TURNS[:2], dataclasses.replace(THREE_TURNS[2], finish_reason="length")]
    receipt, staged = _chain(turns)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.truncated
    assert len(row.input_ids) == 12


def test_a_parent_finishing_on_length_does_not_truncate_the_row() -> None:
    turns = [dataclasses.replace(THREE_TURNS[0], finish_reason="length"), *THREE_TURNS[1:]]
    receipt, staged = _chain(turns)
    assert not reassemble(receipt, staged, max_seq_len=BIG)[0].truncated


def test_row_longer_than_max_seq_len_is_cut_with_its_routes() -> None:
    """verifiers #1394: routes are cut with the tokens, so they stay one row per token."""
    receipt, staged = _chain(THREE_TURNS)
    (full,) = reassemble(receipt, staged, max_seq_len=BIG)
    (cut,) = reassemble(receipt, staged, max_seq_len=8)
    assert cut.truncated
    assert not full.truncated
    assert cut.input_ids == full.input_ids[:8]
    assert cut.loss_mask == full.loss_mask[:8]
    assert cut.logprobs == full.logprobs[:8]
    assert cut.routes is not None
    assert full.routes is not None
    assert cut.routes.shape == (8, LAYERS, TOPK)
    assert cut.routes.data == full.routes.data[: 8 * LAYERS * TOPK]


def test_row_of_exactly_max_seq_len_is_not_cut() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=12)
    assert len(row.input_ids) == 12
    assert not row.truncated


def test_cut_call_spans_tile_the_row_and_versions_cover_kept_generations() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=6)  # cuts inside the second call's carry
    assert [(s.call_id, s.carry_len, s.gen_len) for s in row.call_spans] == [
        ("c000001", 3, 2),
        ("c000002", 1, 0),
    ]
    assert sum(s.carry_len + s.gen_len for s in row.call_spans) == len(row.input_ids)
    assert (row.weight_version_min, row.weight_version_max) == (3, 3)
    assert list(row.loss_mask) == _expected_mask(row)


@settings(max_examples=40, deadline=None)
@given(rollout=simulated_rollouts(routes=True), data=st.data())
def test_any_cut_is_a_prefix_of_the_full_row(
    rollout: SimulatedRollout, data: st.DataObject
) -> None:
    receipt = _receipt(rollout)
    (full,) = reassemble(receipt, rollout.staged, max_seq_len=BIG)
    limit = data.draw(st.integers(full.prompt_len + 1, len(full.input_ids)))
    (cut,) = reassemble(receipt, rollout.staged, max_seq_len=limit)
    assert cut.input_ids == full.input_ids[:limit]
    assert cut.loss_mask == full.loss_mask[:limit]
    assert cut.logprobs == full.logprobs[:limit]
    assert cut.routes is not None
    assert full.routes is not None
    assert cut.routes.data == full.routes.data[: limit * LAYERS * TOPK]
    assert cut.truncated == (full.truncated or limit < len(full.input_ids))
    assert list(cut.loss_mask) == _expected_mask(cut)
    assert cut.num_generated >= 1


def test_max_seq_len_within_the_prompt_leaves_no_generated_tokens() -> None:
    receipt, staged = _chain(THREE_TURNS)
    for limit in (1, 3):
        with pytest.raises(ReassemblyError) as info:
            reassemble(receipt, staged, max_seq_len=limit)
        assert info.value.code == "no_generated_tokens"
    (row,) = reassemble(receipt, staged, max_seq_len=4)
    assert row.num_generated == 1
    assert row.truncated


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "8", None])
def test_bad_max_seq_len(limit: Any) -> None:
    receipt, staged = _chain(THREE_TURNS)
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=limit)
    assert info.value.code == "bad_max_seq_len"


# ---- verification -------------------------------------------------------------------------


def _tampered(code: str) -> tuple[Receipt, dict[str, StagedCall]]:
    """A three-call chain with exactly one thing wrong, producing ``code``."""
    receipt, staged = _chain(THREE_TURNS)
    key = "run-1/c000002"
    call = staged[key]
    if code == "receipt_poisoned":
        receipt = dataclasses.replace(
            receipt, status="poisoned", failure_reason="stage_failed:timeout"
        )
    elif code == "missing_call":
        del staged[key]
    elif code == "identity_mismatch":
        staged[key] = staged["run-1/c000003"]
    elif code == "parent_mismatch":
        staged[key] = dataclasses.replace(call, parent_id="c000009")
    elif code == "length_mismatch":
        staged[key] = dataclasses.replace(
            call,
            carry_len=call.carry_len + 1,
            gen_len=call.gen_len - 1,
            logprobs=call.logprobs[1:],
            routes=None,
            weight_versions=single_span(call.weight_version, call.gen_len - 1),
            kv_versions=single_span(call.weight_version, call.gen_len - 1),
        )
    elif code == "metadata_mismatch":
        staged[key] = shifted(call, 1)
    elif code == "digest_mismatch":
        tokens = array("I", call.tokens)
        tokens[-1] += 1
        staged[key] = dataclasses.replace(call, tokens=tokens)
    elif code == "chain_mismatch":
        staged[key] = dataclasses.replace(call, chain_hash="0" * 64)
    elif code == "parent_order":
        receipt = dataclasses.replace(receipt, segments=(receipt.segments[0][1:],))
    elif code == "terminal_mismatch":
        receipt = dataclasses.replace(receipt, terminal_call_id="c000002")
    return receipt, staged


VERIFICATION_CODES = [
    "receipt_poisoned",
    "missing_call",
    "identity_mismatch",
    "parent_mismatch",
    "length_mismatch",
    "metadata_mismatch",
    "digest_mismatch",
    "chain_mismatch",
    "parent_order",
    "terminal_mismatch",
]


@pytest.mark.parametrize("code", VERIFICATION_CODES)
def test_every_verification_mismatch_raises_reassembly_error_with_its_code(code: str) -> None:
    receipt, staged = _tampered(code)
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    assert info.value.code == code
    assert isinstance(info.value, VerificationError)


@pytest.mark.parametrize("field", ["tokens", "logprobs", "routes"])
def test_any_altered_payload_is_a_digest_mismatch(field: str) -> None:
    receipt, staged = _chain(THREE_TURNS)
    key = "run-1/c000003"
    call = staged[key]
    value = getattr(call, field)
    if field == "routes":
        data = array(value.data.typecode, value.data)
        data[0] = 7 if data[0] != 7 else 6
        altered: Any = dataclasses.replace(value, data=data)
    else:
        altered = array(value.typecode, value)
        altered[0] = altered[0] + 1
    staged[key] = dataclasses.replace(call, **{field: altered})
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    assert info.value.code == "digest_mismatch"


@settings(max_examples=40, deadline=None)
@given(rollout=simulated_rollouts(), data=st.data())
def test_flipping_any_token_of_any_segment_is_caught(
    rollout: SimulatedRollout, data: st.DataObject
) -> None:
    receipt = _receipt(rollout, segments="all")
    links = [link for segment in receipt.segments for link in segment]
    link = data.draw(st.sampled_from(links))
    call = rollout.staged[link.staging_key]
    tokens = array("I", call.tokens)
    position = data.draw(st.integers(0, len(tokens) - 1))
    tokens[position] ^= 1
    staged = {**rollout.staged, link.staging_key: dataclasses.replace(call, tokens=tokens)}
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    assert info.value.code == "digest_mismatch"


def test_reassembly_error_pickles_with_its_code() -> None:
    import pickle

    receipt, staged = _tampered("missing_call")
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    again = pickle.loads(pickle.dumps(info.value))
    assert (type(again), again.code) == (ReassemblyError, "missing_call")


# ---- routes -------------------------------------------------------------------------------


def test_routes_have_one_row_per_token_and_backfill_each_parents_last_token() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.routes is not None
    assert row.routes.dtype == "int8"
    per_token = [row.routes.data[t * LAYERS * TOPK] for t in range(row.routes.shape[0])]
    # tokens of call i were routed by call i's pass (expert i); a parent's last generated token
    # is first run by the child's prefill, so its route comes from the child (expert i + 1).
    assert per_token == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, -1]
    assert row.backfilled_route_rows == 2
    assert unknown_rows(row.routes) == (11,)


def test_final_tokens_route_is_refreshed_from_the_next_turn() -> None:
    """NeMo-RL #3485: a parent's final token must take its route from the next turn's prefill."""
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.routes is not None
    width = LAYERS * TOPK
    for span, child in zip(row.call_spans, list(staged.values())[1:], strict=False):
        last = span.start + span.carry_len + span.gen_len - 1
        assert child.routes is not None
        assert row.routes.data[last * width : (last + 1) * width] == child.routes.data[:width]
        assert -1 not in row.routes.data[last * width : (last + 1) * width]


def test_the_terminals_last_token_route_stays_unknown() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.routes is not None
    assert unknown_rows(row.routes)[-1] == len(row.input_ids) - 1


@settings(max_examples=40, deadline=None)
@given(rollout=simulated_rollouts(routes=True))
def test_simulated_chain_backfills_calls_minus_one_rows(rollout: SimulatedRollout) -> None:
    receipt = _receipt(rollout, segments="all")
    for index, row in enumerate(reassemble(receipt, rollout.staged, max_seq_len=BIG)):
        calls = _segment_calls(receipt, rollout.staged, index)
        assert row.backfilled_route_rows == len(calls) - 1
        assert row.routes is not None
        assert row.routes.shape == (len(row.input_ids), LAYERS, TOPK)
        assert unknown_rows(row.routes) == (len(row.input_ids) - 1,)


def test_a_child_without_a_prefill_route_leaves_the_parents_last_token_unknown() -> None:
    rows = [[[1] * TOPK for _ in range(LAYERS)] for _ in range(9)]  # 7 prompt + 3 output - 1
    rows[4] = [[-1] * TOPK for _ in range(LAYERS)]  # the parent's last generated token
    child = dataclasses.replace(THREE_TURNS[1], routes=routes_from_rows(rows, dtype="int8"))
    receipt, staged = _chain([THREE_TURNS[0], child])
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.backfilled_route_rows == 0
    assert row.routes is not None
    assert unknown_rows(row.routes) == (4, len(row.input_ids) - 1)


def test_routes_on_some_calls_only_is_routes_partial() -> None:
    receipt, staged = _chain(
        [THREE_TURNS[0], dataclasses.replace(THREE_TURNS[1], routes=None), THREE_TURNS[2]]
    )
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    assert info.value.code == "routes_partial"


def test_dtype_change_along_the_chain_is_chain_dtype_mismatch() -> None:
    receipt, staged = _chain(
        [THREE_TURNS[0], dataclasses.replace(THREE_TURNS[1], dtype="int16"), THREE_TURNS[2]]
    )
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    assert info.value.code == "chain_dtype_mismatch"


def test_shape_change_along_the_chain_is_chain_shape_mismatch() -> None:
    receipt, staged = _chain([THREE_TURNS[0], dataclasses.replace(THREE_TURNS[1], layers=3)])
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, staged, max_seq_len=BIG)
    assert info.value.code == "chain_shape_mismatch"


def test_rows_without_routes_have_none() -> None:
    receipt, staged = _chain([dataclasses.replace(t, routes=None) for t in THREE_TURNS])
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.routes is None
    assert row.backfilled_route_rows == 0


# ---- zero-copy buffers --------------------------------------------------------------------


def test_row_buffers_expose_the_buffer_protocol() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.routes is not None
    for buffer, fmt, itemsize in (
        (row.input_ids, "I", 4),
        (row.loss_mask, "B", 1),
        (row.logprobs, "f", 4),
        (row.routes.data, "b", 1),
    ):
        view = memoryview(buffer)
        assert (view.format, view.itemsize, view.nbytes) == (fmt, itemsize, itemsize * len(buffer))


def test_torch_views_share_the_rows_memory() -> None:
    torch = pytest.importorskip("torch")
    receipt, staged = _chain(THREE_TURNS)
    (row,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert row.routes is not None
    views: dict[str, tuple[array[Any], Any]] = {
        "input_ids": (row.input_ids, torch.frombuffer(row.input_ids, dtype=torch.uint32)),
        "loss_mask": (row.loss_mask, torch.frombuffer(row.loss_mask, dtype=torch.uint8)),
        "logprobs": (row.logprobs, torch.frombuffer(row.logprobs, dtype=torch.float32)),
        "routes": (row.routes.data, torch.frombuffer(row.routes.data, dtype=torch.int8)),
    }
    for name, (buffer, tensor) in views.items():
        assert tensor.data_ptr() == buffer.buffer_info()[0], name
        assert tensor.tolist() == buffer.tolist(), name
    routes = views["routes"][1].view(*row.routes.shape)
    assert routes[-1].eq(-1).all()
    ids = views["input_ids"][1].to(torch.int64)  # what an embedding lookup takes
    assert ids.tolist() == list(row.input_ids)


# ---- placeholders -------------------------------------------------------------------------


def test_placeholder_row_is_masked_out_and_keeps_its_reason() -> None:
    row = placeholder_row("run-1", "stage_failed:timeout", reward=0.0)
    assert (row.sample_mask, row.reason, row.reason_bucket) == (
        0,
        "stage_failed:timeout",
        "stage_failed",
    )
    assert row.num_generated == 0
    assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs) == 1
    assert row.routes is None
    assert row.call_spans == ()
    assert row.terminal_call_id is None
    assert row.reward == 0.0
    assert row.key == "run-1/s000"


def test_placeholder_like_a_routed_row_has_unknown_routes_of_the_same_layout() -> None:
    receipt, staged = _chain([dataclasses.replace(t, dtype="int16") for t in THREE_TURNS])
    (real,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert real.routes is not None
    row = placeholder_row("run-2", "missing_rows", like=real, segment=2)
    assert row.routes is not None
    assert (row.routes.dtype, row.routes.shape) == ("int16", (1, LAYERS, TOPK))
    assert unknown_rows(row.routes) == (0,)
    assert row.key == "run-2/s002"


def test_placeholder_like_an_unrouted_row_has_no_routes() -> None:
    receipt, staged = _chain([dataclasses.replace(t, routes=None) for t in THREE_TURNS])
    (real,) = reassemble(receipt, staged, max_seq_len=BIG)
    assert placeholder_row("run-2", "missing_rows", like=real).routes is None


def test_unknown_reason_falls_in_the_unknown_bucket() -> None:
    assert placeholder_row("run-1", "made_up:thing").reason_bucket == "unknown"


def test_a_masked_out_row_without_a_reason_is_rejected() -> None:
    row = placeholder_row("run-1", "missing_rows")
    with pytest.raises(InvalidStagedCall) as info:
        dataclasses.replace(row, reason=None)
    assert info.value.code == "bad_sample_mask"
    receipt, staged = _chain(THREE_TURNS)
    (real,) = reassemble(receipt, staged, max_seq_len=BIG)
    with pytest.raises(InvalidStagedCall):
        dataclasses.replace(real, reason="missing_rows")  # a valid row cannot carry a reason
    with pytest.raises(InvalidStagedCall):
        dataclasses.replace(real, sample_mask=2)


def test_row_buffers_of_different_lengths_are_rejected() -> None:
    receipt, staged = _chain(THREE_TURNS)
    (real,) = reassemble(receipt, staged, max_seq_len=BIG)
    with pytest.raises(InvalidStagedCall) as info:
        dataclasses.replace(real, loss_mask=real.loss_mask[:-1])
    assert info.value.code == "row_length_mismatch"


def test_simulate_rollout_reassembles_deterministically() -> None:
    first = simulate_rollout("det", seed=7, turns=5, routes=True)
    second = simulate_rollout("det", seed=7, turns=5, routes=True)
    assert reassemble(_receipt(first), first.staged, max_seq_len=BIG) == reassemble(
        _receipt(second), second.staged, max_seq_len=BIG
    )
