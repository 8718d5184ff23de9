"""Engine-free checks of the issue #24 fixes (the real-server cases are in test_hostile2.py)."""

from __future__ import annotations

import pytest

from tokcap_vllm._admission import normalize_message, output_fingerprint
from tokcap_vllm._errors import BadRequest
from tokcap_vllm._weight_state import begin
from tokcap_vllm.weights import WeightPhase, WeightPushError, WeightState


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [990, 5_000, 100_000])
def test_tool_call_arguments_nested_too_deeply_are_a_typed_400(depth: int) -> None:
    """B3/B9: a RecursionError from Python's JSON codec is the caller's nesting, not a 500."""
    message = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}
    message["tool_calls"][0]["function"]["arguments"] = _deep(depth)  # type: ignore[index]
    with pytest.raises(BadRequest) as raised:
        normalize_message(message)
    assert raised.value.code == "bad_json"
    with pytest.raises(BadRequest):
        output_fingerprint("", [{"function": {"name": "f", "arguments": _deep(depth)}}])


def test_tool_call_arguments_of_ordinary_depth_still_normalise() -> None:
    message = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[]"}}]}
    assert normalize_message(message)["tool_calls"][0]["function"]["arguments"] == []


@pytest.mark.parametrize("version", [2**63, 2**64, 10**30])
def test_a_weight_version_the_ledger_cannot_store_is_refused_before_the_push(version: int) -> None:
    """B8: the ledger stores weight versions below 2**63; a larger one is ``bad_version``."""
    state = WeightState(phase=WeightPhase.READY, version=3)
    with pytest.raises(WeightPushError) as raised:
        begin(state, version)
    assert raised.value.code == "bad_version"
    assert begin(state, 2**63 - 1).target == 2**63 - 1
