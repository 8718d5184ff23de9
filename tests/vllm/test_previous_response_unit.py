"""``previous_response_id``, resolved from the rollout's own calls, with no engine.

A Responses request may name its parent: the named response must be a call of the same
rollout that was answered (responded or committed) with its output items kept, else the
request is refused (``unknown_previous_response``). The child reaches vLLM with the chain's
items spelled out as its ``input`` and without ``previous_response_id`` (vLLM needs no
store), and is planned as the chat request vLLM converts it into.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.vllm._rules import Flag, NoLock
from tokcap_vllm.errors import BadRequest
from tokcap_vllm.gate._planning import ChatPlan
from tokcap_vllm.gate._records import GateCall, ResponsesTurn
from tokcap_vllm.gate._responses import previous_turn, responses_request
from tokcap_vllm.gate._rollouts import RolloutBook

ASKED = [{"role": "user", "content": "2 + 3?"}]
ANSWER = [
    {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "5", "annotations": []}],
    }
]


def _answered(book: RolloutBook, rollout_id: str, response_id: str, *ops: str) -> GateCall:
    """A Responses call of ``rollout_id`` that answered ``response_id``, moved by ``ops``."""
    record = book.join(rollout_id)
    call = book.begin(record, kind="chat")
    assert call is not None
    book.advance(record, "append")
    call.call_id = f"c{len(record.calls) + 1:06d}"  # type: ignore[assignment]
    call.plan = ChatPlan(None, 0, [1], "")
    call.response_id = response_id
    call.thread = ResponsesTurn(None, list(ASKED), list(ANSWER))
    for op in ops:
        book.step(call, op)
    return call


def _book() -> RolloutBook:
    return RolloutBook(max_open=8, flag=Flag, lock=NoLock)


def _refused(book: RolloutBook, rollout_id: str, response_id: str) -> str:
    with pytest.raises(BadRequest) as refused:
        previous_turn(book, rollout_id, response_id)
    return refused.value.code


@pytest.mark.parametrize(
    "ops", [("admit", "finish", "respond"), ("admit", "finish", "respond", "commit")]
)
def test_an_answered_call_of_the_rollout_is_the_named_parent(ops: tuple[str, ...]) -> None:
    book = _book()
    call = _answered(book, "r1", "resp_1", *ops)
    _answered(book, "r1", "resp_2", *ops)
    assert previous_turn(book, "r1", "resp_1") is call


@pytest.mark.parametrize(
    "ops", [("admit",), ("admit", "finish"), ("admit", "finish", "respond", "fail")]
)
def test_a_call_not_answered_is_no_parent(ops: tuple[str, ...]) -> None:
    book = _book()
    _answered(book, "r1", "resp_1", *ops)
    assert _refused(book, "r1", "resp_1") == "unknown_previous_response"


def test_a_call_that_kept_no_items_or_names_another_response_is_no_parent() -> None:
    book = _book()
    chat = _answered(book, "r1", "resp_chat", "admit", "finish", "respond")
    chat.thread = None  # a chat call answered with that id
    pending = _answered(book, "r1", "resp_2", "admit", "finish", "respond")
    assert pending.thread is not None
    pending.thread.output_items = None  # its output items not kept
    for named in ("resp_chat", "resp_2", "resp_3"):
        assert _refused(book, "r1", named) == "unknown_previous_response"
    _answered(book, "r2", "resp_9", "admit", "finish", "respond")
    assert _refused(book, "r1", "resp_9") == "unknown_previous_response"  # another rollout's
    assert _refused(book, "r3", "resp_9") == "unknown_previous_response"  # no such rollout


def test_a_child_is_sent_with_its_chain_spelled_out_and_planned_as_vllm_converts_it() -> None:
    book = _book()
    parent = _answered(book, "r1", "resp_1", "admit", "finish", "respond")
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
