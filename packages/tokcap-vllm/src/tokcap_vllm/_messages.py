"""Anthropic Messages requests, captured as the chat requests vLLM makes of them.

vLLM serves ``/v1/messages`` by converting the request into a chat-completion request
(``AnthropicServingMessages.to_chat_completion_request``: the system prompt, ``tool_use``
blocks as assistant tool calls, ``tool_result`` blocks as ``role: "tool"`` messages,
thinking as reasoning, tools and tool choice) and answering it with its chat handler. The
gate plans the captured call on that same conversion, made by vLLM's own code with the
server handler's own settings (whether inline system messages are merged into the first;
the effort a disabled thinking maps to), so the chat turn it plans is the one vLLM runs and
a Messages call chains with chat calls of the same rollout exactly as a chat call would.
"""

from __future__ import annotations

from typing import Any

from ._vllm import require_vllm
from ._wire import ChatBody, chat_body, decode_object
from .errors import BadRequest, Unsupported

__all__ = ["messages_request"]


async def messages_request(body: bytes, handler: Any) -> ChatBody:
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
    return chat_body(
        list(chat.messages),
        tools=tools,
        template_kwargs=chat.chat_template_kwargs,
        reasoning_effort=chat.reasoning_effort,
        stream=bool(chat.stream),
    )
