"""The row a finished call stages, with no engine: its weight and KV versions, its parent link.

A call's KV spans follow from the version its prompt was salted with and how each push
during the call treated calls in flight: a push that kept their KV (``kv_kept``) leaves the
older KV under the newer sampling; one that recomputed it moves the KV to its version.
A child's row chains on its parent's chain hash, a root's on none.
"""

from __future__ import annotations

from array import array

import pytest

from tests.vllm._rules import REQUEST, Flag, NoLock
from tokcap_core import Entry
from tokcap_core.ledger import chain_hash
from tokcap_core.provenance import VersionSpan
from tokcap_vllm.extend import EngineResult
from tokcap_vllm.gate._planning import ChatPlan, Observed
from tokcap_vllm.gate._records import GateCall
from tokcap_vllm.gate._rollouts import RolloutBook
from tokcap_vllm.gate._staging import staged_call


def _call(book: RolloutBook, prompt: list[int], parent: GateCall | None = None) -> GateCall:
    """A call of ``kv-1`` admitted with the engine prompt ``prompt``: a root, or a child of
    ``parent`` (committed by then: a child is admitted only on a committed parent)."""
    call = book.call_received("kv-1", kind="completion")
    assert book.call_claimed(call) is None
    book.call_planning(call, REQUEST)
    prefix = 0 if parent is None or parent.staged is None else len(parent.staged.tokens)
    plan = ChatPlan(
        None if parent is None else parent.call_id,
        prefix,
        prompt,
        "",
        request_fingerprint="fp",
        formation="root" if parent is None else "extend",
    )
    assert isinstance(book.call_planned(call, plan, admitted_at=1, unserved=None), Entry)
    assert call.parent is parent
    return call


def _result(prompt: list[int], spans: tuple[VersionSpan, ...], salt: int) -> EngineResult:
    return EngineResult(
        prompt_ids=prompt,
        output_ids=array("I", [7, 8]),
        logprobs=array("f", [-0.5, -0.25]),
        finish_reason="length",
        weight_version=spans[0].version,
        weight_version_last=spans[-1].version,
        weight_versions=spans,
        salt_version=salt,
        text="",
    )


MID_CALL_PUSH = (VersionSpan(version=1, start=0, end=1), VersionSpan(version=2, start=1, end=2))
"""The first token sampled with version 1, the second with 2 (a push landed in between)."""


@pytest.mark.parametrize(
    ("kv_kept", "kv"),
    [
        ((2,), (VersionSpan(version=1, start=0, end=2),)),
        ((), MID_CALL_PUSH),
        ((1,), MID_CALL_PUSH),  # keeping version 1's KV says nothing of version 2's push
    ],
)
def test_a_push_that_kept_kv_leaves_the_older_kv_under_the_newer_sampling(
    kv_kept: tuple[int, ...], kv: tuple[VersionSpan, ...]
) -> None:
    call = _call(RolloutBook(max_open=4, flag=Flag, lock=NoLock), [1, 2, 3])
    staged = staged_call(call, _result([1, 2, 3], MID_CALL_PUSH, salt=1), False, kv_kept=kv_kept)
    assert staged.weight_versions == MID_CALL_PUSH
    assert staged.kv_versions == kv


def test_a_prompt_salted_with_an_older_version_keeps_that_kv_until_a_recomputing_push() -> None:
    call = _call(RolloutBook(max_open=4, flag=Flag, lock=NoLock), [1, 2, 3])
    spans = (VersionSpan(version=2, start=0, end=2),)
    staged = staged_call(call, _result([1, 2, 3], spans, salt=1), False, kv_kept=(2,))
    assert staged.kv_versions == (VersionSpan(version=1, start=0, end=2),)
    recomputed = staged_call(call, _result([1, 2, 3], spans, salt=1), False)
    assert recomputed.kv_versions == spans


def test_a_child_row_chains_on_its_staged_parent_and_a_root_on_none() -> None:
    book = RolloutBook(max_open=4, flag=Flag, lock=NoLock)
    spans = (VersionSpan(version=0, start=0, end=2),)
    parent = _call(book, [1, 2, 3])
    done = _result([1, 2, 3], spans, salt=0)
    assert book.call_finished(parent, done)
    parent.staged = staged_call(parent, done, False)
    assert parent.staged.chain_hash == chain_hash(None, parent.staged.digest)
    assert book.call_responded(parent, Observed(None, None, None), None)
    assert book.call_committed(parent)[1] is None
    child = _call(book, [1, 2, 3, 7, 8, 9], parent)
    staged = staged_call(child, _result([1, 2, 3, 7, 8, 9], spans, salt=0), False)
    assert staged.parent_id == parent.call_id
    assert staged.chain_hash == chain_hash(parent.staged.chain_hash, staged.digest)
