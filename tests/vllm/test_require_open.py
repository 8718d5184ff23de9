"""A gate run with ``require_open`` captures only rollouts opened on it (no engine needed:
`RolloutBook.call_received` is where a captured request joins its rollout,
`CapturePath.enter` tells it with the gate's ``require_open``)."""

from __future__ import annotations

import anyio
import pytest

from tokcap_core import assemble_receipt, verify_manifest
from tokcap_core.ledger import manifest_of
from tokcap_vllm import Gate, GateConfig
from tokcap_vllm.errors import RolloutNotFound
from tokcap_vllm.gate._records import GateCall


def test_a_call_of_a_rollout_nobody_opened_is_unknown() -> None:
    gate = Gate(GateConfig(require_open=True))
    with pytest.raises(RolloutNotFound) as refused:
        _begin(gate, "never-opened")
    assert refused.value.code == "unknown_rollout"
    assert gate.book.records() == []  # the refusal made nothing


def test_an_opened_rollout_is_captured_and_opening_again_changes_nothing() -> None:
    gate = Gate(GateConfig(require_open=True))
    gate.open("r1")
    gate.open("r1")
    call = _begin(gate, "r1")
    assert call is not None
    gate.book.call_dropped(call)  # a refused request does not forget an opened rollout
    assert _begin(gate, "r1") is not None


def test_without_require_open_any_rollout_joins_on_its_first_call() -> None:
    assert _begin(Gate(GateConfig()), "free") is not None


def test_an_opened_rollout_without_calls_closes_with_nothing_to_train() -> None:
    gate = Gate(GateConfig(require_open=True))
    gate.open("idle")
    head = anyio.run(gate.close, "idle", 1.0)
    state = verify_manifest(manifest_of(gate.ledger("idle")), expected_head=head)
    assert assemble_receipt(state).failure_reason == "no_terminal"
    gate.release("idle")
    with pytest.raises(RolloutNotFound):
        _begin(gate, "idle")


def _begin(gate: Gate, rollout_id: str) -> GateCall | None:
    """What `CapturePath.enter` does first: the book receives the call."""
    return gate.book.call_received(rollout_id, kind="chat", require_open=gate.config.require_open)
