"""Anthropic Messages requests, captured as the chat requests vLLM makes of them.

vLLM serves ``/v1/messages`` by converting the request into a chat-completion request
(``AnthropicServingMessages.to_chat_completion_request``: the system prompt, ``tool_use``
blocks as assistant tool calls, ``tool_result`` blocks as ``role: "tool"`` messages,
thinking as reasoning, tools and tool choice) and answering it with its chat handler. The
gate plans the captured call on that same conversion, made by vLLM's own code with the
server handler's own settings (whether inline system messages are merged into the first;
the effort a disabled thinking maps to), so the chat turn it plans is the one vLLM runs and
a Messages call chains with chat calls of the same rollout exactly as a chat call would.

A tokcap/vLLM extension: a captured Messages request may carry vLLM's ``structured_outputs``
(the chat request's guided-decoding field; with the ``anthropic`` client, in
``extra_body``). vLLM's Messages request has no such field and would drop it; the gate
validates it as vLLM's chat request does (one kind of constraint, no constraint beside a
named tool choice, a well-formed structural tag; else 400 ``bad_body``) and constrains the
engine call by it, so a structural tag of ``<tool_call>`` blocks makes the model's own
output parse, by the server's tool parser, into ``tool_use`` blocks of the answer. The
extension is bounded (`MAX_STRUCTURED_OUTPUTS_BYTES` of JSON, else 413
``structured_outputs_too_large``) before vLLM sees it: compiling a grammar grows with the
schema, and one 20,000-property schema held the engine for minutes, stalling every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from ..errors import BadRequest, TooLarge, Unsupported
from ._vllm import require_vllm
from ._wire import ChatBody, chat_body, decode_object

__all__ = ["MAX_STRUCTURED_OUTPUTS_BYTES", "MessagesRequest", "messages_request"]

MAX_STRUCTURED_OUTPUTS_BYTES: Final = 64 << 10
"""The largest ``structured_outputs`` extension (its JSON) a captured Messages call may carry."""


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A Messages request as the gate captures it."""

    chat: ChatBody
    """The chat request vLLM's conversion makes of it (what the gate plans)."""
    structured_outputs: Any
    """vLLM's ``StructuredOutputsParams`` from the extension field (module doc), or None."""


async def messages_request(body: bytes, handler: Any) -> MessagesRequest:
    """The chat request vLLM's Messages ``handler`` makes of ``body`` (typed errors if none)."""
    if handler is None:
        raise Unsupported("messages_unavailable", "this server does not serve /v1/messages")
    protocol = require_vllm("vllm.entrypoints.anthropic.protocol")
    raw = decode_object(body)
    try:
        request = protocol.AnthropicMessagesRequest.model_validate(raw)
    except ValueError as e:  # pydantic's ValidationError
        raise BadRequest("bad_body", f"invalid Messages request: {str(e)[:300]}") from e
    effort = "none"
    if request.thinking is not None and request.thinking.type == "disabled":
        effort = await handler._get_disabled_thinking_effort()
    try:
        chat = handler.to_chat_completion_request(
            request,
            merge_inline_system=bool(getattr(handler, "_merge_inline_system", False)),
            disabled_thinking_effort=effort,
        )
    except ValueError as e:  # a tool change naming an undeclared tool, a bad tool schema, ...
        raise BadRequest("bad_body", f"invalid Messages request: {str(e)[:300]}") from e
    tools = [tool.model_dump() for tool in chat.tools] if chat.tools else None
    planned = chat_body(
        list(chat.messages),
        tools=tools,
        template_kwargs=chat.chat_template_kwargs,
        reasoning_effort=chat.reasoning_effort,
        stream=bool(chat.stream),
    )
    extension = raw.get("structured_outputs")
    if extension is None:
        return MessagesRequest(planned, None)
    return MessagesRequest(planned, _constraint(chat, tools, extension))


def _constraint(chat: Any, tools: list[dict[str, Any]] | None, extension: object) -> Any:
    """``extension`` validated by vLLM's chat request beside the converted ``chat``."""
    protocol = require_vllm("vllm.entrypoints.openai.chat_completion.protocol")
    invalid = require_vllm("vllm.exceptions").VLLMValidationError
    if not isinstance(extension, dict):  # vLLM's own check would fail on it untyped
        raise BadRequest("bad_body", "structured_outputs must be an object")
    size = len(msgspec.json.encode(extension))
    if size > MAX_STRUCTURED_OUTPUTS_BYTES:
        raise TooLarge(
            "structured_outputs_too_large",
            f"structured_outputs is {size} bytes of JSON; at most {MAX_STRUCTURED_OUTPUTS_BYTES}",
        )
    fields: dict[str, Any] = {"model": chat.model, "messages": [], "tools": tools}
    choice = chat.tool_choice
    if choice is not None:  # the validators read dicts
        fields["tool_choice"] = choice.model_dump() if hasattr(choice, "model_dump") else choice
    try:
        checked = protocol.ChatCompletionRequest.model_validate(
            {**fields, "structured_outputs": extension}
        )
    except (ValueError, invalid) as e:  # pydantic's ValidationError; vLLM's own
        raise BadRequest("bad_body", f"invalid structured_outputs: {str(e)[:300]}") from e
    return checked.extract_structured_outputs()
