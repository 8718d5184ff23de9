"""``previous_response_id``, resolved from the rollout's own calls, with no engine.

A Responses request may name its parent: the named response must be a call of the same
rollout that was answered (responded or committed) with its output items kept, else the
request is refused (``unknown_previous_response``): a call in flight has no response id
yet, and one that failed or was contained after its answer names no parent. The child
reaches vLLM with the chain's items spelled out as its ``input`` and without
``previous_response_id`` (vLLM needs no store), and is planned as the chat request vLLM
converts it into.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.vllm._rules import Flag, NoLock, admitted, result
from tokcap_vllm.errors import BadRequest
from tokcap_vllm.gate._planning import Observed
from tokcap_vllm.gate._records import (
    COMMITTED,
    CONTAINED,
    FAILED,
    RESPONDED,
    UNCAPTURED,
    GateCall,
    ResponsesTurn,
)
from tokcap_vllm.gate._responses import previous_turn, responses_request
from tokcap_vllm.gate._rollouts import RolloutBook
from tokcap_vllm.gate._staging import staged_call

ASKED = [{"role": "user", "content": "2 + 3?"}]
ANSWER = [
    {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "5", "annotations": []}],
    }
]


def _answered(
    book: RolloutBook,
    rollout_id: str,
    response_id: str,
    stage: str,
    *,
    responses: bool = True,
    items: bool = True,
) -> GateCall:
    """A call of ``rollout_id`` (a Responses call unless ``responses`` is false) told its
    events up to ``stage``: ``admitted``, ``finished``, ``responded`` (the harness got
    ``response_id``, and the call kept its output items if ``items``), ``committed``,
    ``failed`` (responded, then its sink write failed) or ``contained`` (responded, then
    a step of it failed inside the gate)."""
    turn = ResponsesTurn(None, list(ASKED)) if responses else None
    call = admitted(book, rollout_id, thread=turn)
    if stage == "admitted":
        return call
    assert book.call_finished(call, result())
    call.staged = staged_call(call, result(), False)
    if stage == "finished":
        return call
    if turn is not None and items:
        turn.output_items = list(ANSWER)  # as the capture path keeps them at the last byte
    assert book.call_responded(call, Observed(response_id, "5", None), None)
    assert call.response_id == response_id
    if stage == "committed":
        assert book.call_committed(call) == (call.rollout.ledger.entries[-1], None)
    elif stage == "failed":
        call.stage_error = "injected_put_failure"
        assert book.call_committed(call)[0] is not None
    elif stage == "contained":
        book.call_contained(call, "gate_failed:Boom")
    else:
        assert stage == "responded"
    return call


def _book() -> RolloutBook:
    return RolloutBook(max_open=8, flag=Flag, lock=NoLock)


def _refused(book: RolloutBook, rollout_id: str, response_id: str) -> str:
    with pytest.raises(BadRequest) as refused:
        previous_turn(book, rollout_id, response_id)
    return refused.value.code


@pytest.mark.parametrize("stage", ["responded", "committed"])
def test_an_answered_call_of_the_rollout_is_the_named_parent(stage: str) -> None:
    book = _book()
    call = _answered(book, "r1", "resp_1", stage)
    _answered(book, "r1", "resp_2", stage)
    assert previous_turn(book, "r1", "resp_1") is call
    assert call.phase is (RESPONDED if stage == "responded" else COMMITTED)


@pytest.mark.parametrize("stage", ["admitted", "finished", "failed", "contained"])
def test_a_call_not_answered_is_no_parent(stage: str) -> None:
    """In flight (it has no response id until it responds), or answered and then failed
    or contained (it keeps its response id and items, and still names no parent)."""
    book = _book()
    call = _answered(book, "r1", "resp_1", stage)
    if stage in ("failed", "contained"):
        assert call.response_id == "resp_1"
        assert call.thread is not None
        assert call.thread.output_items is not None
        assert call.phase is (FAILED if stage == "failed" else CONTAINED)
        assert call.rollout.phase is UNCAPTURED  # still open: its calls are looked at
    else:
        assert call.response_id is None
    assert _refused(book, "r1", "resp_1") == "unknown_previous_response"


def test_a_call_that_kept_no_items_or_names_another_response_is_no_parent() -> None:
    book = _book()
    chat = _answered(book, "r1", "resp_chat", "responded", responses=False)
    assert chat.thread is None  # a chat call answered with that id
    pending = _answered(book, "r1", "resp_2", "responded", items=False)
    assert pending.thread is not None
    assert pending.thread.output_items is None  # its output items not kept
    for named in ("resp_chat", "resp_2", "resp_3"):
        assert _refused(book, "r1", named) == "unknown_previous_response"
    _answered(book, "r2", "resp_9", "responded")
    assert _refused(book, "r1", "resp_9") == "unknown_previous_response"  # another rollout's
    assert _refused(book, "r3", "resp_9") == "unknown_previous_response"  # no such rollout


def test_a_child_is_sent_with_its_chain_spelled_out_and_planned_as_vllm_converts_it() -> None:
    book = _book()
    parent = _answered(book, "r1", "resp_1", "responded")
    own = [{"role": "user", "content": [{"type": "input_text", "text": "and 4?"}]}]
    body = {"model": "m", "previous_response_id": "resp_1", "input": own, "request_id": "mine"}
    made = responses_request(json.dumps(body).encode(), book=book, rollout_id="r1", harmony=False)
    sent = json.loads(made.body)
    assert "previous_response_id" not in sent
    assert sent["input"] == [*ASKED, *ANSWER, *own]
    assert (sent["model"], sent["request_id"], made.request_id) == ("m", "mine", "mine")
    assert made.parent is parent
    assert made.turn.previous is parent.thread
    assert made.turn.input_items == own
    roles = [m["role"] for m in made.chat.messages]
    assert roles == ["user", "assistant", "user"]
    assert made.chat.messages[2]["content"] == [{"type": "text", "text": "and 4?"}]


def test_only_text_parts_are_read_as_text() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}
    own: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "what is it?"}, image]}
    ]
    body = json.dumps({"model": "m", "input": own}).encode()
    made = responses_request(body, book=_book(), rollout_id="r1", harmony=False)
    parts = made.chat.messages[0]["content"]
    assert parts[0] == {"type": "text", "text": "what is it?"}
    assert parts[1]["type"] != "text"
