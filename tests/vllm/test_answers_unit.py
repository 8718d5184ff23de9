"""Messages and Responses answers read as the chat turn they become, with no engine.

A captured call's returned turn is read the way the harness's next request converts it
(`tokcap_vllm.gate._answers`): Anthropic text blocks that are not empty joined by newlines in
block order, ``tool_use`` blocks as tool calls (``{}`` for an empty input); Responses
``message`` items give their first text part, ``function_call`` items tool calls. What
goes out is the server's, but the readers never trust its shape: an event or block of
another shape is skipped, never a crash.
"""

from __future__ import annotations

from typing import Any

from tokcap_vllm.gate._answers import MessagesAnswer, ResponsesAnswer, answer_reader


def _messages(*events: dict[str, Any]) -> MessagesAnswer:
    answer = MessagesAnswer()
    for event in events:
        answer.event(event)
    return answer


def _block(index: Any, block: Any) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: Any, delta: Any) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def test_each_api_has_its_reader_and_chat_none() -> None:
    assert isinstance(answer_reader("messages"), MessagesAnswer)
    assert isinstance(answer_reader("responses"), ResponsesAnswer)
    assert answer_reader("chat") is None
    assert answer_reader("completion") is None


def test_a_streamed_messages_answer_joins_its_text_blocks_in_order_and_its_tool_uses() -> None:
    answer = _messages(
        {"type": "message_start", "message": {"id": "msg_1"}},
        {"type": "message_start", "message": {"id": "msg_2"}},  # the first id stays
        _block(2, {"type": "text", "text": "b"}),
        _block(0, {"type": "text", "text": "a"}),
        _block(1, {"type": "tool_use", "name": "calc", "input": {}}),
        _block(3, {"type": "text", "text": ""}),  # an empty block adds no line
        _block(4, {"type": "tool_use", "name": "noop", "input": {}}),
        _delta(0, {"type": "text_delta", "text": "+"}),
        _delta(1, {"type": "input_json_delta", "partial_json": '{"x": '}),
        _delta(1, {"type": "input_json_delta", "partial_json": "1}"}),
    )
    assert not answer.done
    answer.event({"type": "message_stop"})
    assert (answer.done, answer.response_id, answer.content()) == (True, "msg_1", "a+\nb")
    assert answer.tool_calls() == [
        {"type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}},
        {"type": "function", "function": {"name": "noop", "arguments": "{}"}},
    ]


def test_a_messages_event_of_another_shape_is_skipped() -> None:
    answer = _messages(
        {"type": "message_start", "message": "msg_1"},
        {"type": "message_start"},
        _block("0", {"type": "text", "text": "index not a number"}),
        _block(0, "not a block"),
        _block(0, {"type": "thinking", "thinking": "not a turn's text"}),
        _block(1, {"type": "text", "text": "t"}),
        _block(2, {"type": "tool_use", "name": "f"}),
        _delta(9, {"type": "text_delta", "text": "no such block"}),
        _delta("1", {"type": "text_delta", "text": "index not a number"}),
        _delta(1, "not a delta"),
        _delta(1, {"type": "input_json_delta", "partial_json": "not text"}),
        _delta(2, {"type": "text_delta", "text": "not a tool's"}),
        _delta(1, {"type": "text_delta", "text": 5}),
        {"type": "ping"},
    )
    assert (answer.response_id, answer.done, answer.content()) == (None, False, "t")
    assert answer.tool_calls() == [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]


def test_a_whole_messages_answer_reads_its_blocks() -> None:
    answer = MessagesAnswer()
    assert answer.tool_calls() is None
    answer.whole(
        {
            "id": "msg_9",
            "content": [
                {"type": "text", "text": "x"},
                "not a block",
                {"type": "tool_use", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "name": 7, "input": None},
                {"type": "text", "text": "y"},
            ],
        }
    )
    assert (answer.response_id, answer.content()) == ("msg_9", "x\ny")
    assert answer.tool_calls() == [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"type": "function", "function": {"name": "", "arguments": "{}"}},
    ]
    other = MessagesAnswer()
    other.whole({"id": 5, "content": "not a list"})
    assert (other.response_id, other.content(), other.tool_calls()) == (None, "", None)


def _items(*items: Any) -> dict[str, Any]:
    return {"id": "resp_1", "output": list(items)}


def test_a_responses_answer_reads_its_message_and_function_call_items() -> None:
    answer = ResponsesAnswer()
    assert (answer.content(), answer.tool_calls(), answer.output) == ("", None, None)
    answer.event({"type": "response.created", "response": {"id": "resp_1"}})
    answer.event({"type": "response.output_text.delta", "delta": "x"})  # no response: skipped
    answer.event({"type": "response.in_progress", "response": {"id": "resp_2", "output": []}})
    assert (answer.response_id, answer.done, answer.output) == ("resp_1", False, None)
    message = {
        "type": "message",
        "content": [{"type": "output_text", "text": "hi"}, {"text": "2nd"}],
    }
    call = {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}
    completed = _items(
        {"type": "reasoning", "content": [{"text": "not the turn"}]},
        message,
        {"type": "message", "content": []},
        {"type": "message", "content": ["not a part"]},
        "not an item",
        call,
        {"type": "function_call", "name": None, "arguments": None},
    )
    answer.event({"type": "response.completed", "response": completed})
    assert (answer.done, answer.content()) == (True, "hi")
    assert answer.output is not None
    assert len(answer.output) == 6  # every item but the one that is not an object
    assert answer.tool_calls() == [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"type": "function", "function": {"name": "", "arguments": ""}},
    ]


def test_a_responses_event_of_another_shape_is_skipped() -> None:
    answer = ResponsesAnswer()
    answer.event({"type": "response.completed", "response": "not an object"})
    answer.event({"type": "response.created", "response": {"id": 3}})
    assert (answer.done, answer.response_id, answer.output) == (False, None, None)
    answer.whole({"id": "resp_5", "output": "not a list"})
    assert (answer.response_id, answer.output, answer.tool_calls()) == ("resp_5", [], None)
