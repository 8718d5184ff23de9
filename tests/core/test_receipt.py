"""Receipts: terminal selection rules, poisoning (scoped to its rollout), forests and sink keys."""

from __future__ import annotations

import json

import pytest

from tokcap_core import (
    Ledger,
    Receipt,
    StagedCall,
    VerificationError,
    assemble_receipt,
    reasons,
    verify_manifest,
)
from tokcap_core.ids import staging_key
from tokcap_core.ledger import (
    Admitted,
    Closed,
    Failed,
    Poisoned,
    TerminalDeclared,
    Witnesses,
)
from tokcap_core.provenance import VersionSpan
from tokcap_core.simulate import simulate_rollout, stage_call


class Builder:
    """A rollout built by hand: a ledger plus the staged calls a gate would have written."""

    def __init__(self, rollout_id: str = "rx") -> None:
        self.ledger = Ledger(rollout_id)
        self.calls: dict[str, StagedCall] = {}
        self.clock = 0

    def admit(
        self,
        parent: str | None = None,
        *,
        break_cause: str | None = None,
        splice_cause: str | None = None,
    ) -> str:
        call_id = self.ledger.next_call_id()
        self.clock += 1
        prefix = self.calls[parent].cum_len if parent else 0
        formation = "root" if parent is None else ("splice" if splice_cause else "extend")
        self.ledger.append(
            Admitted(
                call_id=call_id,
                parent_id=parent,
                prefix_len=prefix,
                admitted_at=self.clock,
                request_fingerprint=f"req-{call_id}",
                formation=formation,
                break_cause=break_cause,
                splice_cause=splice_cause,
            )
        )
        return call_id

    def stage(
        self,
        parent: str | None = None,
        *,
        fingerprint: str | None = None,
        break_cause: str | None = None,
        splice_cause: str | None = None,
        weight_version_last: int | None = None,
    ) -> str:
        """Admit and stage a call with two carried and two generated tokens (the second
        sampled by ``weight_version_last`` when given); return its id."""
        call_id = self.admit(parent, break_cause=break_cause, splice_cause=splice_cause)
        up = self.calls[parent] if parent else None
        call = stage_call(
            self.ledger,
            call_id,
            up,
            prompt_ids=[0] * (up.cum_len if up else 0) + [self.clock, 7],
            output_ids=[self.clock, 9],
            logprobs=[-0.5, -1.5],
            weight_versions=None
            if weight_version_last is None
            else (
                VersionSpan(version=0, start=0, end=1),
                VersionSpan(version=weight_version_last, start=1, end=2),
            ),
            response_id=f"resp-{call_id}",
            output_fingerprint=fingerprint or f"out-{call_id}",
        )
        self.calls[call_id] = call
        return call_id

    def fail(
        self, parent: str | None = None, *, served: bool, reason: str = "engine_failed:aborted"
    ) -> str:
        call_id = self.admit(parent)
        self.ledger.append(Failed(call_id=call_id, reason=reason, served=served))
        return call_id

    def declare(self, by: str, value: str) -> None:
        self.ledger.append(TerminalDeclared(by=by, value=value))  # type: ignore[arg-type]

    def close(
        self,
        reward: float | None = 1.0,
        *,
        response_id: str | None = None,
        content_fingerprint: str | None = None,
    ) -> None:
        witnesses = Witnesses(response_id=response_id, content_fingerprint=content_fingerprint)
        self.ledger.append(Closed(reward=reward, witnesses=witnesses))

    def receipt(self, segments: str = "terminal") -> Receipt:
        return assemble_receipt(self.ledger.state, segments=segments)  # type: ignore[arg-type]


def chain_of_three() -> tuple[Builder, str, str, str]:
    b = Builder()
    c1 = b.stage()
    c2 = b.stage(c1)
    c3 = b.stage(c2)
    return b, c1, c2, c3


def ids(receipt: Receipt, segment: int = 0) -> list[str]:
    return [c.call_id for c in receipt.segments[segment]]


def assert_poisoned(receipt: Receipt, reason: str) -> None:
    assert (receipt.status, receipt.failure_reason) == ("poisoned", reason)
    assert not receipt.ok
    assert receipt.segments == ()
    assert receipt.terminal_call_id is None
    assert receipt.terminal_selection is None


# ---- terminal rules -----------------------------------------------------------------------


def test_declared_terminal_by_call_id_wins_over_the_heuristic() -> None:
    b, c1, c2, _ = chain_of_three()
    b.declare("call_id", c2)
    b.close()
    receipt = b.receipt()
    assert receipt.ok
    assert (receipt.terminal_call_id, receipt.terminal_selection) == (c2, "declared")
    assert ids(receipt) == [c1, c2]


def test_declared_terminal_by_response_id() -> None:
    b, c1, c2, _ = chain_of_three()
    b.declare("response_id", f"resp-{c2}")
    b.close()
    receipt = b.receipt()
    assert (receipt.terminal_call_id, receipt.terminal_selection) == (c2, "declared")
    assert ids(receipt) == [c1, c2]


@pytest.mark.parametrize(("by", "value"), [("call_id", "c000099"), ("response_id", "resp-nowhere")])
def test_declared_terminal_missing_poisons_and_never_falls_back(by: str, value: str) -> None:
    b, _, _, c3 = chain_of_three()
    b.declare(by, value)
    b.close(
        response_id=f"resp-{c3}", content_fingerprint=f"out-{c3}"
    )  # witnesses that would have matched
    assert_poisoned(b.receipt(), reasons.DECLARED_TERMINAL_MISSING)


def test_declared_terminal_naming_an_unstaged_call_is_missing() -> None:
    b, _, c2, _ = chain_of_three()
    failed = b.fail(c2, served=False)
    b.declare("call_id", failed)
    b.close()
    assert_poisoned(b.receipt(), reasons.DECLARED_TERMINAL_MISSING)


@pytest.mark.parametrize(
    ("witness", "value", "selection"),
    [("response_id", "resp-{}", "response_id"), ("content_fingerprint", "out-{}", "content")],
)
def test_one_witness_selects_the_terminal(witness: str, value: str, selection: str) -> None:
    b, c1, c2, _ = chain_of_three()
    b.close(**{witness: value.format(c2)})
    receipt = b.receipt()
    assert (receipt.terminal_call_id, receipt.terminal_selection) == (c2, selection)
    assert ids(receipt) == [c1, c2]


def test_agreeing_witnesses_select_by_response_id() -> None:
    b, _, c2, _ = chain_of_three()
    b.close(response_id=f"resp-{c2}", content_fingerprint=f"out-{c2}")
    assert (b.receipt().terminal_call_id, b.receipt().terminal_selection) == (c2, "response_id")


def test_witnesses_that_disagree_poison_with_witness_disagreement() -> None:
    b, _, c2, c3 = chain_of_three()
    b.close(response_id=f"resp-{c2}", content_fingerprint=f"out-{c3}")
    assert_poisoned(b.receipt(), reasons.WITNESS_DISAGREEMENT)


@pytest.mark.parametrize("witness", ["response_id", "content_fingerprint"])
def test_a_witness_that_matches_no_call_poisons_with_witness_unmatched(witness: str) -> None:
    b, *_ = chain_of_three()
    b.close(**{witness: "nobody"})
    assert_poisoned(b.receipt(), reasons.WITNESS_UNMATCHED)


def test_a_content_witness_matching_two_calls_is_ambiguous() -> None:
    b = Builder()
    root = b.stage()
    b.stage(root, fingerprint="same")
    b.stage(root, fingerprint="same")
    b.close(content_fingerprint="same")
    assert_poisoned(b.receipt(), reasons.AMBIGUOUS_TERMINAL)


def test_heuristic_picks_the_deepest_chain_of_the_latest_root() -> None:
    b, *_ = chain_of_three()  # a deeper, earlier root
    r2 = b.stage(break_cause="history_rewritten")
    leaf = b.stage(r2)
    b.close()
    receipt = b.receipt()
    assert (receipt.terminal_call_id, receipt.terminal_selection) == (leaf, "heuristic")
    assert ids(receipt) == [r2, leaf]


def test_two_equally_deep_leaves_under_the_latest_root_are_ambiguous() -> None:
    b = Builder()
    root = b.stage()
    b.stage(root)
    b.stage(root)
    b.close()
    assert_poisoned(b.receipt(), reasons.AMBIGUOUS_TERMINAL)


def test_a_tie_under_an_earlier_root_does_not_matter() -> None:
    b = Builder()
    root = b.stage()
    b.stage(root)
    b.stage(root)
    r2 = b.stage(break_cause="history_rewritten")
    b.close()
    receipt = b.receipt()
    assert (receipt.terminal_call_id, receipt.terminal_selection) == (r2, "heuristic")


# ---- poisoning -----------------------------------------------------------------------------


def test_an_offchain_unserved_failure_does_not_poison() -> None:
    b, c1, c2, c3 = chain_of_three()
    failed = b.fail(c3, served=False)
    b.close()
    receipt = b.receipt()
    assert receipt.ok
    assert ids(receipt) == [c1, c2, c3]
    assert staging_key("rx", failed) in receipt.sink_keys


def test_a_served_failure_poisons_its_own_rollout_only() -> None:
    bad, good = Builder("bad"), Builder("good")
    for b in (bad, good):
        b.stage()
    bad.fail(served=True, reason="stage_failed:sink_timeout")
    good.fail(served=False)
    bad.close()
    good.close()
    assert_poisoned(bad.receipt(), "stage_failed:sink_timeout")
    assert good.receipt().ok


def test_a_call_left_admitted_at_close_poisons_with_uncommitted_call() -> None:
    b, _, _, c3 = chain_of_three()
    b.admit(c3)
    b.close()
    assert_poisoned(b.receipt(), reasons.UNCOMMITTED_CALL)


def test_a_poisoned_event_poisons_with_its_reason() -> None:
    b, *_ = chain_of_three()
    b.ledger.append(Poisoned(reason="gate_restarted"))
    assert_poisoned(b.receipt(), "gate_restarted")


def test_an_open_rollout_has_no_receipt_yet() -> None:
    b, *_ = chain_of_three()
    assert_poisoned(b.receipt(), reasons.NOT_CLOSED)


def test_a_rollout_without_staged_calls_has_no_terminal() -> None:
    b = Builder()
    b.fail(served=False)
    b.close()
    assert_poisoned(b.receipt(), reasons.NO_TERMINAL)


def test_a_poisoned_receipt_still_lists_every_sink_key_to_clear() -> None:
    b, c1, c2, c3 = chain_of_three()
    b.admit(c3)
    b.close()
    assert b.receipt().sink_keys == tuple(staging_key("rx", c) for c in (c1, c2, c3, "c000004"))


# ---- forests, segments, sink keys ---------------------------------------------------------


def test_a_forest_gives_one_segment_per_root_with_segments_all() -> None:
    sim = simulate_rollout("forest", seed=9, turns=3, roots=2)
    state = verify_manifest(sim.manifest)
    everything = assemble_receipt(state, segments="all")
    assert everything.ok
    assert len(everything.segments) == 2
    assert everything.segments[0][-1].call_id == everything.terminal_call_id
    roots = [seg[0] for seg in everything.segments]
    assert all(root.parent_id is None for root in roots)
    assert roots[0].call_id != roots[1].call_id
    terminal_only = assemble_receipt(state, segments="terminal")
    assert terminal_only.segments == everything.segments[:1]
    assert terminal_only.break_causes == everything.break_causes == ("history_rewritten",)


def test_segment_zero_ends_at_a_terminal_declared_in_an_earlier_root() -> None:
    b, c1, c2, c3 = chain_of_three()
    r2 = b.stage(break_cause="reasoning_stripped")
    leaf = b.stage(r2)
    b.declare("call_id", c3)
    b.close()
    receipt = b.receipt("all")
    assert [ids(receipt, 0), ids(receipt, 1)] == [[c1, c2, c3], [r2, leaf]]
    assert receipt.break_causes == ("reasoning_stripped",)


def test_segments_link_root_to_terminal_with_the_ledgers_coordinates() -> None:
    b, *_ = chain_of_three()
    b.close()
    receipt = b.receipt()
    previous = None
    for link in receipt.segments[0]:
        call = b.calls[link.call_id]
        assert link.staging_key == call.key
        assert (link.call_digest, link.chain_hash) == (call.digest, call.chain_hash)
        assert (link.prefix_len, link.carry_len, link.gen_len, link.cum_len) == (
            call.prefix_len, call.carry_len, call.gen_len, call.cum_len,
        )  # fmt: skip
        assert link.parent_id == (previous.call_id if previous else None)
        previous = link


def test_sink_keys_list_every_admitted_call_including_offchain_ones() -> None:
    sim = simulate_rollout("keys", seed=4, turns=3, roots=2, offchain_failures=2)
    state = verify_manifest(sim.manifest)
    receipt = assemble_receipt(state, segments="all")
    assert receipt.ok
    assert receipt.sink_keys == tuple(staging_key("keys", c) for c in state.calls)
    on_chain = {link.staging_key for seg in receipt.segments for link in seg}
    offchain = [staging_key("keys", c) for c, r in state.calls.items() if r.failed is not None]
    assert len(offchain) == 2
    assert set(offchain) <= set(receipt.sink_keys) - on_chain


def test_break_causes_list_why_each_later_root_started() -> None:
    b = Builder()
    b.stage()
    b.stage(break_cause="template_mismatch")
    b.stage(break_cause="history_rewritten")
    b.close()
    assert b.receipt().break_causes == ("template_mismatch", "history_rewritten")


def test_splices_stay_on_the_chain_and_are_counted_by_cause() -> None:
    b = Builder()
    c1 = b.stage()
    c2 = b.stage(c1, splice_cause="special_tokens")
    c3 = b.stage(c2)
    c4 = b.stage(c3, splice_cause="tool_call_format")
    b.close()
    receipt = b.receipt()
    assert ids(receipt) == [c1, c2, c3, c4]
    assert receipt.splice_causes == ("special_tokens", "tool_call_format")
    assert receipt.break_causes == ()
    assert [(c.formation, c.splice_cause) for c in receipt.segments[0]] == [
        ("root", None),
        ("splice", "special_tokens"),
        ("extend", None),
        ("splice", "tool_call_format"),
    ]
    assert receipt.to_json()["splice_causes"] == ["special_tokens", "tool_call_format"]


def test_a_call_generated_across_a_weight_push_reports_both_versions() -> None:
    b = Builder()
    c1 = b.stage(weight_version_last=3)
    b.close()
    (link,) = b.receipt().segments[0]
    assert (link.call_id, link.weight_version, link.weight_version_last) == (c1, 0, 3)
    assert link.weight_versions == (
        VersionSpan(version=0, start=0, end=1),
        VersionSpan(version=3, start=1, end=2),
    )
    assert link.kv_versions == link.weight_versions


def test_receipt_carries_reward_and_ledger_head_and_prints_as_json() -> None:
    b, *_ = chain_of_three()
    b.close(reward=-0.25)
    receipt = b.receipt()
    assert receipt.reward == -0.25
    assert receipt.ledger_head == b.ledger.head
    doc = json.loads(json.dumps(receipt.to_json()))
    assert doc["status"] == "verified"
    assert doc["ledger_head"] == {"seq": b.ledger.head[0], "hash": b.ledger.head[1]}
    assert [c["call_id"] for c in doc["segments"][0]] == ids(receipt)


def test_an_unknown_segment_mode_is_refused() -> None:
    b, *_ = chain_of_three()
    b.close()
    with pytest.raises(VerificationError) as info:
        b.receipt("some")
    assert info.value.code == "bad_segment_mode"
