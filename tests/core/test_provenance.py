"""Per-token provenance (capture format v3): span laws, KV spans by push mode, staleness
from receipts alone equal to staleness from rows, and the verifier's staleness bound."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap_core import VerificationError, assemble_receipt, reassemble
from tokcap_core.errors import InvalidStagedCall, LedgerProtocolError
from tokcap_core.golden import shipped_vectors
from tokcap_core.ledger import Entry, Manifest, encode_manifest, replay
from tokcap_core.provenance import (
    VersionSpan,
    check_spans,
    check_staleness,
    kv_spans,
    receipt_staleness,
    row_staleness,
    spans_from_json,
    spans_to_json,
    token_versions,
)
from tokcap_core.simulate import simulate_rollout
from tokcap_core.testing import simulated_rollouts

from .test_cli import cli


@st.composite
def weight_spans(draw: Any) -> tuple[VersionSpan, ...]:
    """Rising versions over contiguous, non-empty token ranges."""
    count = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
    version = draw(st.integers(0, 4))
    out, at = [], 0
    for length in lengths:
        out.append(VersionSpan(version=version, start=at, end=at + length))
        at += length
        version += draw(st.integers(1, 3))
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(spans=weight_spans(), data=st.data())
def test_kv_spans_cover_the_tokens_and_never_run_ahead_of_the_weights(
    spans: tuple[VersionSpan, ...], data: st.DataObject
) -> None:
    salt = data.draw(st.integers(0, spans[0].version))
    recomputed = data.draw(st.sets(st.integers(0, spans[-1].version + 1)))
    kv = kv_spans(spans, salt_version=salt, recomputed=recomputed.__contains__)
    sampled, kv_tokens = token_versions(spans), token_versions(kv)
    assert len(kv_tokens) == len(sampled)
    assert all(salt <= k <= v for k, v in zip(kv_tokens, sampled, strict=True))
    assert kv_tokens == sorted(kv_tokens)
    assert all(a.version < b.version for a, b in itertools.pairwise(kv))


@settings(max_examples=100, deadline=None)
@given(spans=weight_spans())
def test_recompute_leaves_no_stale_kv_and_keep_leaves_the_prompts_version(
    spans: tuple[VersionSpan, ...],
) -> None:
    first = spans[0].version
    assert kv_spans(spans, salt_version=first, recomputed=lambda _: True) == spans
    kept = kv_spans(spans, salt_version=first, recomputed=lambda _: False)
    assert kept == (VersionSpan(version=first, start=0, end=spans[-1].end),)


def test_a_call_queued_across_a_keep_push_counts_its_prompt_as_the_salted_version() -> None:
    # admitted (salted) at 3, first token sampled by 4 after a keep push: the prompt may sit
    # on cached blocks of 3, so its KV is recorded as 3
    spans = (VersionSpan(version=4, start=0, end=2),)
    assert kv_spans(spans, salt_version=3, recomputed=lambda _: False) == (
        VersionSpan(version=3, start=0, end=2),
    )
    assert kv_spans(spans, salt_version=3, recomputed=lambda v: v == 4) == spans


@settings(max_examples=100, deadline=None)
@given(spans=weight_spans())
def test_spans_round_trip_through_json(spans: tuple[VersionSpan, ...]) -> None:
    assert spans_from_json(json.loads(json.dumps(spans_to_json(spans)))) == spans
    assert spans_from_json(None) is None


@pytest.mark.parametrize(
    "bad",
    [
        [[1, 0, 2], [1, 2, 3]],  # neighbours of one version
        [[2, 0, 2], [1, 2, 3]],  # a falling version
        [[1, 0, 2], [2, 3, 4]],  # a gap
        [[1, 1, 4]],  # not from 0
        [[1, 0, 3]],  # short of gen_len
    ],
)
def test_spans_that_do_not_tile_the_generated_tokens_are_refused(bad: list[list[int]]) -> None:
    spans = spans_from_json(bad)
    assert spans is not None
    with pytest.raises(InvalidStagedCall) as info:
        check_spans(spans, 4, what="weight_versions")
    assert info.value.code == "bad_spans"


def test_kv_newer_than_the_sampling_weights_is_refused() -> None:
    call = simulate_rollout("p", seed=0, turns=1).calls[0]
    sampled = (VersionSpan(version=call.weight_version, start=0, end=call.gen_len),)
    newer = (VersionSpan(version=call.weight_version + 1, start=0, end=call.gen_len),)
    with pytest.raises(InvalidStagedCall) as info:
        dataclasses.replace(call, weight_versions=sampled, kv_versions=newer)
    assert info.value.code == "bad_spans"


@settings(max_examples=60, deadline=None)
@given(rollout=simulated_rollouts(max_turns=5, max_roots=2), trained=st.integers(0, 6))
def test_staleness_from_receipts_alone_equals_staleness_from_the_rows(
    rollout: Any, trained: int
) -> None:
    receipt = assemble_receipt(rollout.ledger.state, segments="all")
    if not receipt.ok:
        return
    rows = reassemble(receipt, rollout.calls, max_seq_len=1 << 30)
    from_rows = [row_staleness(row, trained) for row in rows]
    total = from_rows[0]
    for more in from_rows[1:]:
        total = total + more
    assert receipt_staleness(receipt, trained) == total
    # a loop over every generated token of every row agrees
    sampled = [v for row in rows for s in row.call_spans for v in token_versions(s.weight_versions)]
    kv = [v for row in rows for s in row.call_spans for v in token_versions(s.kv_versions)]
    assert total.tokens == len(sampled) == sum(sum(r.loss_mask) for r in rows)
    assert total.staleness_max == max((max(trained - v, 0) for v in sampled), default=0)
    assert total.stale_tokens == sum(trained > v for v in sampled)
    assert total.stale_kv_tokens == sum(k < v for k, v in zip(kv, sampled, strict=True))


@settings(max_examples=60, deadline=None)
@given(rollout=simulated_rollouts(max_turns=4, max_roots=1), trained=st.integers(0, 6))
def test_the_staleness_bound_holds_exactly_at_the_largest_staleness(
    rollout: Any, trained: int
) -> None:
    receipt = assemble_receipt(rollout.ledger.state)
    if not receipt.ok:
        return
    worst = receipt_staleness(receipt, trained).staleness_max
    assert check_staleness([receipt], trained_version=trained, max_staleness=worst) == []
    if worst > 0:
        (violation,) = check_staleness([receipt], trained_version=trained, max_staleness=worst - 1)
        assert violation.rollout_id == receipt.rollout_id
        with pytest.raises(VerificationError) as info:
            check_staleness(
                [receipt], trained_version=trained, max_staleness=worst - 1, raise_=True
            )
        assert info.value.code == "stale_tokens"


def test_spans_cannot_be_stripped_from_a_ledger() -> None:
    """A format v3 ``Staged`` entry hashes under its own domain: dropping its spans (to pass
    it off as a v2 event) breaks the chain."""
    doc = shipped_vectors()
    (case,) = [r for r in doc["rollouts"] if r["name"] == "pushed-in-flight"]
    from tokcap_core import decode_manifest

    manifest = decode_manifest(json.dumps(case["manifest"]))
    entries = list(manifest.entries)
    index = next(i for i, e in enumerate(entries) if type(e.event).__name__ == "Staged")
    event = dataclasses.replace(entries[index].event, weight_versions=None, kv_versions=None)
    entries[index] = Entry(
        seq=entries[index].seq, event=event, prev_hash=entries[index].prev_hash,
        hash=entries[index].hash,
    )  # fmt: skip
    with pytest.raises(VerificationError) as info:
        replay(manifest.rollout_id, entries)
    assert info.value.code == "bad_entry_hash"
    stripped = Manifest(
        rollout_id=manifest.rollout_id,
        entries=tuple(entries),
        head_seq=manifest.head_seq,
        head_hash=manifest.head_hash,
    )
    assert json.loads(encode_manifest(stripped))["format"] == "tokcap/manifest/v3"


def test_a_staged_event_with_half_its_provenance_is_refused() -> None:
    call = simulate_rollout("p", seed=0, turns=1).calls[0]
    from tokcap_core.ledger import Staged

    with pytest.raises(LedgerProtocolError) as info:
        dataclasses.replace(Staged.for_call(call), kv_versions=None)
    assert info.value.code == "bad_event_field"


def test_the_verifier_checks_a_batch_against_a_staleness_bound(tmp_path: Path) -> None:
    doc = shipped_vectors()
    pushed = tmp_path / "pushed.json"
    (case,) = [r for r in doc["rollouts"] if r["name"] == "pushed-in-flight"]
    pushed.write_text(json.dumps(case["manifest"]))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc["rollouts"][0]["manifest"]))
    ok = cli("verify", pushed, "--max-staleness", "2", "--trained-version", "5")
    assert ok.returncode == 0, ok.stderr
    staleness = json.loads(ok.stdout)["staleness"]["rollouts"]["golden-e"]
    assert (staleness["staleness_max"], staleness["stale_kv_tokens"]) == (2, 3)
    over = cli(
        "verify", pushed, "--batch-manifest", other, "--max-staleness", "1",
        "--trained-version", "5",
    )  # fmt: skip
    assert over.returncode == 3
    report = json.loads(over.stdout)
    assert report["error"]["code"] == "stale_tokens"
    assert set(report["staleness"]["rollouts"]) == {"golden-e", "golden-a"}
    usage = cli("verify", pushed, "--max-staleness", "1")
    assert usage.returncode == 2
