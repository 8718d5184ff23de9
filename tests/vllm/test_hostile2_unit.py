"""Engine-free checks of the issue #24 fixes (the real-server cases are in test_hostile2.py)."""

from __future__ import annotations

import pytest

from tokcap_vllm.errors import BadRequest
from tokcap_vllm.fingerprints import normalize_message, output_fingerprint
from tokcap_vllm.transfer._weight_state import begin
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


@pytest.mark.parametrize(
    "path", ["/v1/messages/count_tokens", "/v1/responses/r/cancel", "/v1/embeddings", "/tokenize"]
)
def test_the_rollout_header_refuses_what_the_path_form_refuses(path: str) -> None:
    """B4/B5: a POST naming a rollout by header on an endpoint the gate does not capture is
    ``uncaptured_endpoint``, as on the rollout path; without the header it passes untouched."""
    from tokcap_vllm.errors import RolloutNotFound
    from tokcap_vllm.gate._routing import route_request

    prefix = "/tokcap/rollouts/"
    for raw, headers in ((path, ["r1"]), (f"{prefix}r1{path}", [])):
        if not path.startswith("/v1/"):
            continue
        with pytest.raises(RolloutNotFound) as raised:
            route_request(raw.encode(), raw, "POST", headers, prefix=prefix)
        assert raised.value.code == "uncaptured_endpoint"
    with pytest.raises(RolloutNotFound):
        route_request(path.encode(), path, "POST", ["r1"], prefix=prefix)
    plain = route_request(path.encode(), path, "POST", [], prefix=prefix)
    assert (plain.rollout_id, plain.path, plain.endpoint) == (None, path, None)
    models = route_request(b"/v1/models", "/v1/models", "GET", ["r1"], prefix=prefix)
    assert (models.rollout_id, models.endpoint) == ("r1", None)  # a GET is served, not captured
    chat = route_request(
        b"/v1/chat/completions/", "/v1/chat/completions/", "POST", ["r1"], prefix=prefix
    )
    assert (chat.path, chat.endpoint) == ("/v1/chat/completions", "chat")


@pytest.mark.parametrize(
    "request_id",
    ["", "a" * 248, "tab\there", "new\nline", "caf\u00e9", "x" * 10_000, "nul\x00"],
)
def test_a_request_id_the_ledger_cannot_store_is_refused(request_id: str) -> None:
    """B1/B2: vLLM's response id is ``chatcmpl-`` + the request id; the ledger stores 1..256
    printable ASCII characters, so a chat request id is 1..247 of them."""
    from tokcap_vllm.gate._wire import check_request_id

    with pytest.raises(BadRequest) as raised:
        check_request_id(request_id, "chat")
    assert raised.value.code == "bad_request_id"


def test_request_ids_up_to_the_bound_are_kept_as_given() -> None:
    from tokcap_vllm.gate._wire import check_request_id

    assert check_request_id("a" * 247, "chat") == "a" * 247
    assert check_request_id("a" * 251, "completion") == "a" * 251
    assert check_request_id("with space ~!", "chat") == "with space ~!"
    with pytest.raises(BadRequest):
        check_request_id("a" * 252, "completion")


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("value", [-1, 0, 5])
def test_truncate_prompt_tokens_is_refused_not_ignored(kind: str, value: int) -> None:
    """Q5: vLLM would truncate the prompt the gate admitted; refused before admission."""
    import json

    from tokcap_vllm.errors import Unsupported
    from tokcap_vllm.gate._wire import decode_body

    body = {"truncate_prompt_tokens": value}
    body |= {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    with pytest.raises(Unsupported) as raised:
        decode_body(json.dumps(body).encode(), kind, token_ids_allowed=False)
    assert raised.value.code == "truncate_prompt_tokens_unsupported"
