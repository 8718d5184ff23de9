"""OpenAI Responses requests, captured as the chat requests vLLM renders them as.

vLLM serves ``/v1/responses`` (without harmony) by converting the request's instructions and
input items (messages, ``function_call``, ``function_call_output``, reasoning items) into
chat messages (``construct_input_messages``) and its function tools into chat tools
(``construct_tool_dicts``), then templating them like a chat request and calling the
engine once. The gate plans the captured call on that same conversion, by vLLM's own code.

``previous_response_id`` is an explicit parent link. vLLM resolves it only from its
in-memory response store (``VLLM_ENABLE_RESPONSES_API_STORE``, never evicted; it keeps a
previous response's messages but drops its function calls and reasoning). The gate resolves
it from its rollout's own calls instead: the named response must be a call of the same
rollout that was answered (responded or committed), else the request is refused
(``unknown_previous_response``). Each captured Responses call keeps its own input items and
the output items the harness received (a `ResponsesTurn`, held by its call and freed with
its rollout at release); a child's request reaches vLLM with the chain's items spelled out
as its ``input`` (no ``previous_response_id``, so vLLM needs no store), as a stateless
harness would have sent it, and is planned on the named parent only.

Refused with a typed error (each would make vLLM loop ``generate`` inside one request, or
answer from outside the request): ``background`` (``background_unsupported``), harmony
models (``harmony_unsupported``), tools other than plain functions: built-in, MCP, custom
or namespaced (``tool_type_unsupported``), ``previous_input_messages``, a partial last
message to continue (``continue_final_message_unsupported``) and ``truncation="auto"``
(``truncation_unsupported``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..errors import BadRequest, RolloutNotFound, Unsupported
from ._records import COMMITTED, RESPONDED, ResponsesTurn
from ._vllm import require_vllm
from ._wire import ChatBody, chat_body, decode_object

if TYPE_CHECKING:
    from ._records import GateCall
    from ._rollouts import RolloutBook

__all__ = ["ResponsesRequest", "ResponsesTurn", "previous_turn", "responses_request"]

_UTILS: Final = "vllm.entrypoints.openai.responses.utils"
_TEXT_PARTS: Final = frozenset({"input_text", "output_text"})


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses request as the gate captures it."""

    chat: ChatBody
    """The chat request vLLM renders it as (what the gate plans)."""
    body: bytes
    """The body vLLM receives (the chain spelled out when a previous response was named)."""
    turn: ResponsesTurn
    parent: GateCall | None
    """The call ``previous_response_id`` named (the call's only possible parent)."""
    request_id: str | None
    """The body's ``request_id`` (vLLM answers with it as the response id)."""


def previous_turn(book: RolloutBook, rollout_id: str, response_id: str) -> GateCall:
    """The answered Responses call ``response_id`` names in ``rollout_id``; `BadRequest`
    (``unknown_previous_response``) when it names no such call."""
    try:
        calls = list(book.open_record(rollout_id).calls.values())
    except RolloutNotFound:
        calls = []
    for call in calls:
        if (
            call.response_id == response_id
            and (call.phase is RESPONDED or call.phase is COMMITTED)
            and call.thread is not None
            and call.thread.output_items is not None
        ):
            return call
    raise BadRequest(
        "unknown_previous_response",
        f"previous_response_id {response_id[:80]!r} names no answered Responses call of "
        f"rollout {rollout_id}",
    )


def responses_request(
    body: bytes,
    *,
    book: RolloutBook,
    rollout_id: str,
    harmony: bool,
    exclude_tools_when_tool_choice_none: bool = False,
) -> ResponsesRequest:
    """Decode, check and convert one captured Responses request (module docstring)."""
    raw = decode_object(body)
    named = raw.get("previous_response_id")
    own = _own_items(raw.get("input"))
    parent: GateCall | None = None
    if named is not None:
        if not isinstance(named, str):
            raise BadRequest("bad_body", "previous_response_id must be a string")
        parent = previous_turn(book, rollout_id, named)
        assert parent.thread is not None
        raw = {k: v for k, v in raw.items() if k != "previous_response_id"}
        raw["input"] = [*parent.thread.history(), *own]
        body = json.dumps(raw).encode()
    protocol = require_vllm("vllm.entrypoints.openai.responses.protocol")
    try:
        request = protocol.ResponsesRequest.model_validate(raw)
    except ValueError as e:
        raise BadRequest("bad_body", f"invalid Responses request: {str(e)[:300]}") from e
    _check(request, harmony=harmony)
    utils = require_vllm(_UTILS)
    invalid = require_vllm("vllm.exceptions").VLLMValidationError  # not a ValueError
    try:
        messages = utils.construct_input_messages(
            request_instructions=request.instructions, request_input=request.input
        )
        tools = utils.construct_tool_dicts(
            request.tools, request.tool_choice, exclude_tools_when_tool_choice_none
        )
    except (ValueError, invalid) as e:  # an input item vLLM cannot convert
        raise BadRequest("bad_body", f"invalid Responses input: {str(e)[:300]}") from e
    effort = request.reasoning.effort if request.reasoning is not None else None
    chat = chat_body(
        [_text_parts(m) for m in messages],
        tools=tools,
        template_kwargs=request.chat_template_kwargs,
        reasoning_effort=effort,
        stream=bool(request.stream),
        seed=request.seed,
    )
    turn = ResponsesTurn(parent.thread if parent is not None else None, own)
    chosen = raw.get("request_id")
    return ResponsesRequest(chat, body, turn, parent, chosen if isinstance(chosen, str) else None)


def _own_items(value: object) -> list[Any]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise BadRequest("bad_body", "input must be a string or a list of items")


def _check(request: Any, *, harmony: bool) -> None:
    if request.background:
        raise Unsupported(
            "background_unsupported",
            "a background response is generated outside its request and cannot be captured",
        )
    if harmony:
        raise Unsupported(
            "harmony_unsupported",
            "harmony (gpt-oss) Responses calls may loop the engine inside one request; "
            "they cannot be captured call by call yet",
        )
    kinds = sorted({str(tool.type) for tool in request.tools if tool.type != "function"})
    if kinds:
        raise Unsupported(
            "tool_type_unsupported",
            f"captured Responses calls take function tools only (got {', '.join(kinds)}): "
            "built-in and MCP tools make vLLM call the engine again inside one request",
        )
    if request.previous_input_messages:
        raise Unsupported(
            "previous_input_messages_unsupported",
            "previous_input_messages is harmony-only; name the parent with previous_response_id",
        )
    utils = require_vllm(_UTILS)
    if utils.should_continue_final_message(request.input):
        raise Unsupported(
            "continue_final_message_unsupported",
            "continuing a partial last message cannot be captured",
        )
    if request.truncation not in (None, "disabled"):
        raise Unsupported(
            "truncation_unsupported",
            "a captured call runs on the exact ids the gate admitted; truncation would cut "
            "the rollout's history",
        )


def _text_parts(message: Mapping[str, Any]) -> dict[str, Any]:
    """A converted message whose ``input_text``/``output_text`` parts are plain text parts
    (vLLM's chat parser reads the three alike; the gate's planner reads ``text``)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [
            {**part, "type": "text"}
            if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS
            else part
            for part in content
        ]
    return out
