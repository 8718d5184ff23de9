"""The Messages and Responses APIs without an engine: routing, request conversion (vLLM's own
code), the typed refusals, the answer readers and the chain a ``previous_response_id`` names."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from tokcap_vllm.errors import BadRequest, GateError, Unsupported
from tokcap_vllm.gate._answers import MessagesAnswer, ResponsesAnswer
from tokcap_vllm.gate._apis import decode_request, stream_error_event
from tokcap_vllm.gate._rollouts import RolloutBook
from tokcap_vllm.gate._routing import route_request
from tokcap_vllm.gate._wire import ResponseObserver

PREFIX = "/tokcap/rollouts/"


class _State:
    """What vLLM's app state offers the gate: the Messages handler class (its conversion is
    a class method) and a Responses handler and renderer (present, not harmony)."""

    def __init__(self) -> None:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        self.anthropic_serving_messages = AnthropicServingMessages
        self.openai_serving_responses = object()
        self.online_renderer = None


def _decode(kind: str, body: dict[str, Any] | bytes, header: str | None = None) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    book = RolloutBook(max_open=8, flag=anyio.Event, lock=anyio.Lock)

    async def run() -> Any:
        return await decode_request(
            kind,
            raw,
            app_state=_State(),
            book=book,
            rollout_id="r1",
            token_ids_allowed=False,
            header_request_id=header,
        )

    return anyio.run(run)


@pytest.mark.parametrize(
    ("path", "kind"), [("/v1/messages", "messages"), ("/v1/responses/", "responses")]
)
def test_messages_and_responses_are_captured_endpoints(path: str, kind: str) -> None:
    for raw, headers in ((PREFIX + "r1" + path, []), (path, ["r1"])):
        route = route_request(raw.encode(), raw, "POST", headers, prefix=PREFIX)
        assert (route.rollout_id, route.path, route.endpoint) == ("r1", path.rstrip("/"), kind)


def test_a_messages_request_is_planned_as_the_chat_request_vllm_makes_of_it() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be terse."}],
        "tools": [{"name": "calc", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "calc", "input": {"a": 2}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "5"}],
            },
        ],
    }
    decoded = _decode("messages", body, header="abc")
    chat = decoded.parsed
    assert decoded.planned_kind == "chat"
    assert decoded.request_id == "abc"
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2]["tool_calls"][0]["function"] == {
        "name": "calc",
        "arguments": '{"a": 2}',
    }
    assert chat.messages[3]["tool_call_id"] == "t1"
    assert chat.tools[0]["function"]["name"] == "calc"
    assert decoded.body == json.dumps(body).encode()  # vLLM gets the body as sent
    assert decoded.structured_outputs is None


_CALC = [{"name": "calc", "input_schema": {"type": "object"}}]


def _constrained(extension: object, **extra: Any) -> Any:
    body = {
        "model": "m",
        "max_tokens": 8,
        "tools": _CALC,
        "messages": [{"role": "user", "content": "2+3?"}],
        "structured_outputs": extension,
        **extra,
    }
    return _decode("messages", body)


def test_a_messages_request_carries_vllms_structured_outputs_to_the_engine_call() -> None:
    tag = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}})
    assert _constrained({"structural_tag": tag}).structured_outputs.structural_tag == tag
    assert _constrained({"choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]


@pytest.mark.parametrize(
    ("extension", "extra"),
    [
        (7, {}),  # not an object
        ({"json": {}, "regex": "a"}, {}),  # two kinds of constraint
        ({"structural_tag": "{not json"}, {}),
        ({"unknown": 1}, {}),  # no constraint at all
        (
            {"choice": ["a"]},
            {"tool_choice": {"type": "tool", "name": "calc"}},
        ),  # beside a named tool
    ],
)
def test_a_bad_structured_outputs_on_messages_is_typed(extension: object, extra: Any) -> None:
    with pytest.raises(BadRequest) as refused:
        _constrained(extension, **extra)
    assert refused.value.code == "bad_body"


@pytest.mark.parametrize(
    ("kind", "body", "code"),
    [
        ("messages", b"{not json", "bad_json"),
        ("messages", {"model": "m", "messages": []}, "bad_body"),  # no max_tokens
        ("messages", {"model": "m", "max_tokens": 4, "messages": []}, "bad_body"),
        ("responses", b"[1]", "bad_body"),
        ("responses", {"model": "m", "input": 3}, "bad_body"),
        ("responses", {"input": "x", "background": True}, "background_unsupported"),
        ("responses", {"input": "x", "tools": [{"type": "web_search"}]}, "tool_type_unsupported"),
        ("responses", {"input": "x", "truncation": "auto"}, "truncation_unsupported"),
        (
            "responses",
            {"input": "x", "previous_response_id": "resp_1"},
            "unknown_previous_response",
        ),
        ("responses", {"input": "x", "request_id": ""}, "bad_request_id"),
        (  # vLLM's converter raises its own error type (not a ValueError) on it
            "responses",
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "reasoning", "id": "r1", "summary": [], "encrypted_content": "e"},
                ]
            },
            "bad_body",
        ),
        (
            "responses",
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {
                        "type": "message",
                        "role": "assistant",
                        "status": "incomplete",
                        "content": [{"type": "output_text", "text": "par", "annotations": []}],
                        "id": "msg_1",
                    },
                ]
            },
            "continue_final_message_unsupported",
        ),
    ],
)
def test_bad_requests_are_typed(kind: str, body: Any, code: str) -> None:
    with pytest.raises(GateError) as raised:
        _decode(kind, body)
    assert raised.value.code == code
    assert isinstance(raised.value, (BadRequest, Unsupported))


def test_a_responses_request_is_planned_on_vllms_conversion_of_its_items() -> None:
    body = {
        "model": "m",
        "instructions": "Be terse.",
        "request_id": "resp_mine",
        "tools": [{"type": "function", "name": "calc", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
            {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "5"},
        ],
    }
    decoded = _decode("responses", body)
    chat = decoded.parsed
    assert decoded.request_id == "resp_mine"
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[1]["content"] == [{"type": "text", "text": "2+3?"}]
    assert chat.messages[2]["tool_calls"][0]["function"]["name"] == "calc"
    assert chat.tools[0]["function"]["name"] == "calc"
    assert decoded.thread is not None
    assert decoded.thread.input_items == body["input"]
    assert decoded.parent is None


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
        for e in events
    )


def test_a_streamed_messages_answer_reads_as_its_chat_turn() -> None:
    observer = ResponseObserver(keep=False, kind="messages")
    observer.on_start({"status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    observer.on_body(
        _sse(
            {"type": "message_start", "message": {"id": "chatcmpl-1"}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "a"},
            },
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": "t", "name": "calc", "input": {}},
            },
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"a": '},
            },
        )
    )
    assert not observer.stream_done
    observer.on_body(
        _sse(
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": "1}"},
            },
            {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use"}},
            {"type": "content_block_start", "index": 3, "content_block": {"type": "text"}},
            {
                "type": "content_block_delta",
                "index": 3,
                "delta": {"type": "text_delta", "text": "b"},
            },
            {"type": "message_stop"},
        )
    )
    assert observer.stream_done
    observer.finish()
    assert (observer.response_id, observer.content) == ("chatcmpl-1", "a\nb")
    assert observer.tool_calls() == [
        {"type": "function", "function": {"name": "calc", "arguments": '{"a": 1}'}},
        {"type": "function", "function": {"name": "", "arguments": "{}"}},
    ]


def test_a_whole_messages_answer_and_a_whole_responses_answer() -> None:
    messages = MessagesAnswer()
    messages.whole(
        {
            "id": "chatcmpl-2",
            "content": [
                {"type": "thinking", "thinking": "hm"},
                {"type": "text", "text": ""},
                {"type": "tool_use", "id": "t", "name": "calc", "input": {"b": 2}},
            ],
        }
    )
    assert (messages.response_id, messages.content()) == ("chatcmpl-2", "")
    assert messages.tool_calls() == [
        {"type": "function", "function": {"name": "calc", "arguments": '{"b": 2}'}}
    ]
    responses = ResponsesAnswer()
    responses.event({"type": "response.created", "response": {"id": "resp_3", "output": []}})
    assert (responses.response_id, responses.done, responses.output) == ("resp_3", False, None)
    output = [
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
        {"type": "function_call", "name": "calc", "arguments": "{}", "call_id": "c"},
    ]
    responses.event({"type": "response.completed", "response": {"id": "resp_3", "output": output}})
    assert responses.done
    assert responses.output == output
    assert responses.content() == "hi"
    assert responses.tool_calls() == [
        {"type": "function", "function": {"name": "calc", "arguments": "{}"}}
    ]


def test_a_turns_history_is_its_chain_of_items_oldest_first() -> None:
    from tokcap_vllm.gate._responses import ResponsesTurn

    first = ResponsesTurn(None, [{"role": "user", "content": "a"}], [{"type": "message"}])
    second = ResponsesTurn(first, [{"type": "function_call_output"}], [{"type": "function_call"}])
    third = ResponsesTurn(second, [{"role": "user", "content": "b"}])
    assert third.history() == [
        {"role": "user", "content": "a"},
        {"type": "message"},
        {"type": "function_call_output"},
        {"type": "function_call"},
        {"role": "user", "content": "b"},
    ]


def test_the_stream_error_event_is_the_one_each_client_raises_on() -> None:
    anthropic_event = stream_error_event("messages", "rollout_closed", "closed", 409)
    assert anthropic_event.startswith(b"event: error\ndata: ")
    openai_event = stream_error_event("responses", "rollout_closed", "closed", 409)
    assert openai_event.startswith(b"data: ")
    assert json.loads(openai_event[6:])["error"]["code"] == "rollout_closed"
