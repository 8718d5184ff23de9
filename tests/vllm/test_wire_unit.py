"""The wire the gate reads, with no engine: request bodies, converted chat requests, answers.

- `decode_body` refuses what one captured call cannot be (``n``/``best_of`` above one,
  beam search, prompt truncation, token ids the gate does not return, an empty request);
- `chat_body` is the chat request vLLM makes of a Messages or Responses request (a reasoning
  effort reaches the template as vLLM passes it);
- `check_request_id` keeps response ids the ledger can store;
- `ResponseObserver` reads what went back to the harness: a whole JSON answer, or a stream
  of server-sent events merged delta by delta, only from a 200 answer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokcap_vllm.errors import BadRequest, GateError
from tokcap_vllm.gate._wire import ResponseObserver, chat_body, check_request_id, decode_body

HI = [{"role": "user", "content": "hi"}]


def _code(body: dict[str, Any], kind: str = "chat", *, token_ids_allowed: bool = False) -> str:
    with pytest.raises(GateError) as refused:
        decode_body(json.dumps(body).encode(), kind, token_ids_allowed=token_ids_allowed)
    return refused.value.code


def _decodes(body: dict[str, Any], kind: str = "chat", *, token_ids_allowed: bool = False) -> Any:
    return decode_body(json.dumps(body).encode(), kind, token_ids_allowed=token_ids_allowed)


# ---- request bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("n", 2), ("best_of", 2)])
def test_more_than_one_completion_per_call_is_refused(field: str, value: int) -> None:
    assert _code({"messages": HI, field: value}) == "n_unsupported"
    assert _code({"prompt": "x", field: value}, "completion") == "n_unsupported"


def test_one_completion_per_call_is_decoded() -> None:
    parsed = _decodes({"messages": HI, "n": 1, "best_of": 1})
    assert (parsed.n, parsed.best_of, parsed.messages) == (1, 1, HI)


@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
def test_token_ids_are_returned_only_where_the_gate_returns_them(field: str) -> None:
    assert _code({"messages": HI, field: True}) == "token_ids_not_allowed"
    assert getattr(_decodes({"messages": HI, field: True}, token_ids_allowed=True), field)
    assert not getattr(_decodes({"messages": HI}), field)  # not asked: nothing to refuse


@pytest.mark.parametrize(
    ("body", "kind", "code"),
    [
        ({"messages": []}, "chat", "bad_body"),
        (
            {"messages": HI, "continue_final_message": True},
            "chat",
            "continue_final_message_unsupported",
        ),
        (
            {"messages": HI, "truncate_prompt_tokens": 8},
            "chat",
            "truncate_prompt_tokens_unsupported",
        ),
        ({"messages": HI, "use_beam_search": True}, "chat", "beam_search_unsupported"),
        ({"prompt": ""}, "completion", "bad_body"),
        ({"prompt": [[1, 2]]}, "completion", "batched_prompt_unsupported"),
        ({"prompt": [1, -2]}, "completion", "batched_prompt_unsupported"),
        ({"prompt": "x", "echo": True}, "completion", "echo_unsupported"),
    ],
)
def test_what_one_captured_call_cannot_be_is_refused(
    body: dict[str, Any], kind: str, code: str
) -> None:
    assert _code(body, kind) == code


def test_a_prompt_of_ids_or_text_is_one_call() -> None:
    assert _decodes({"prompt": [0, 5]}, "completion").prompt == [0, 5]
    assert _decodes({"prompt": "x"}, "completion").prompt == "x"


# ---- the chat request made of a Messages or Responses request ----------------------------------


def _chat(effort: str | None, kwargs: dict[str, Any] | None = None, tools: Any = None) -> Any:
    return chat_body(HI, tools=tools, template_kwargs=kwargs, reasoning_effort=effort, stream=True)


def test_a_reasoning_effort_reaches_the_template_as_vllm_passes_it() -> None:
    assert _chat("high").chat_template_kwargs == {
        "enable_thinking": True,
        "reasoning_effort": "high",
    }
    assert _chat("none").chat_template_kwargs == {
        "enable_thinking": False,
        "reasoning_effort": "none",
    }
    mine = _chat("high", {"enable_thinking": False, "x": 1}).chat_template_kwargs
    assert mine == {"enable_thinking": False, "x": 1, "reasoning_effort": "high"}  # the request's
    assert _chat(None).chat_template_kwargs is None
    assert _chat(None, {"x": 1}).chat_template_kwargs == {"x": 1}


def test_a_converted_request_keeps_its_tools_and_refuses_an_empty_conversation() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    made = _chat(None, tools=tools)
    assert (made.tools, made.stream, made.messages) == (tools, True, HI)
    assert _chat(None, tools=[]).tools is None
    with pytest.raises(BadRequest) as refused:
        chat_body([], tools=None, template_kwargs=None, reasoning_effort=None, stream=False)
    assert refused.value.code == "bad_body"


# ---- request ids --------------------------------------------------------------------------------


def test_a_request_id_is_one_to_room_printable_ascii_characters() -> None:
    room = 256 - len("chatcmpl-")
    assert check_request_id("a" * room, "chat") == "a" * room
    assert check_request_id("b", "responses") == "b"
    assert check_request_id("c" * 256, "responses") == "c" * 256
    for bad in ("", "a" * (room + 1), "tab\there", "café"):
        with pytest.raises(BadRequest) as refused:
            check_request_id(bad, "chat")
        assert refused.value.code == "bad_request_id"


# ---- what went back to the harness -------------------------------------------------------------


def _start(observer: ResponseObserver, content_type: bytes, status: int = 200) -> None:
    headers = [(b"x-note", b"text/event-stream"), (b"Content-Type", content_type)]
    observer.on_start({"type": "http.response.start", "status": status, "headers": headers})


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def test_a_whole_answer_is_read_once_it_finished() -> None:
    observer = ResponseObserver(keep=True)
    _start(observer, b"application/json")
    calls = [{"function": {"name": "f", "arguments": "{}"}}, {"function": {"name": "g"}}]
    answer = {"id": "chatcmpl-1", "choices": [{"message": {"content": "hi", "tool_calls": calls}}]}
    raw = json.dumps(answer).encode()
    observer.on_body(raw[:10])
    observer.on_body(raw[10:])
    assert (observer.streaming, observer.content) == (False, "")  # read at the end only
    observer.finish()
    assert (observer.status, observer.response_id, observer.content) == (200, "chatcmpl-1", "hi")
    assert observer.tool_calls() == [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"type": "function", "function": {"name": "g", "arguments": ""}},
    ]
    assert observer.chunks == [raw[:10], raw[10:]]


def test_an_error_answer_is_not_read_as_a_turn() -> None:
    observer = ResponseObserver(keep=False)
    _start(observer, b"application/json", status=400)
    observer.on_body(json.dumps({"id": "x", "choices": [{"message": {"content": "no"}}]}).encode())
    observer.finish()
    assert (observer.status, observer.content, observer.response_id) == (400, "", None)
    assert observer.chunks is None


def test_a_stream_is_merged_delta_by_delta_until_done() -> None:
    observer = ResponseObserver(keep=False)
    _start(observer, b"text/event-stream; charset=utf-8")
    first = _event({"id": "chatcmpl-2", "choices": [{"delta": {"content": "he"}}]})
    tool = {"index": 1, "function": {"name": "f", "arguments": '{"a"'}}
    more = {"index": 1, "function": {"arguments": ": 1}"}}
    observer.on_body(first[:7])
    observer.on_body(first[7:] + b": a comment\n\n")
    observer.on_body(_event({"id": "other", "choices": [{"delta": {"content": "y"}}]}))
    observer.on_body(_event({"choices": [{"delta": {"tool_calls": [tool]}}]}))
    observer.on_body(_event({"choices": [{"delta": {"tool_calls": [more]}, "text": None}]}))
    assert not observer.stream_done
    observer.on_body(b"data: [DONE]\n\n")
    observer.finish()
    assert (observer.streaming, observer.stream_done) == (True, True)
    assert (observer.response_id, observer.content) == ("chatcmpl-2", "hey")
    assert observer.tool_calls() == [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


def test_a_completion_stream_reads_its_text() -> None:
    observer = ResponseObserver(keep=False, kind="completion")
    _start(observer, b"text/event-stream")
    observer.on_body(_event({"id": "cmpl-1", "choices": [{"text": "a"}]}) + b"data: {not json\n\n")
    observer.on_body(_event({"choices": [{"text": "b"}, {"text": "other choice"}]}))
    observer.finish()
    assert (observer.content, observer.tool_calls()) == ("ab", None)
