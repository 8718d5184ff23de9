"""The four APIs a rollout may speak, decoded into what capture needs of one request.

Chat completions and completions are read by `tokcap_vllm.gate._wire.decode_body`; Anthropic
Messages (`tokcap_vllm.gate._messages`) and OpenAI Responses (`tokcap_vllm.gate._responses`) become
the chat requests vLLM itself makes of them, so they are planned as chat: a rollout that
mixes APIs on one conversation stays one custody chain wherever the template renders the
turns alike. Each API keeps its own response id (the ledger's ``response_id``), its own
answer reader (`tokcap_vllm.gate._answers`) and its own stream error event.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..api import error_json
from ..errors import Unsupported
from ._messages import messages_request
from ._responses import ResponsesTurn, responses_request
from ._wire import ChatBody, CompletionBody, check_request_id, decode_body

if TYPE_CHECKING:
    from ._planning import PlannedRequest
    from ._records import GateCall
    from ._rollouts import RolloutBook

__all__ = ["CapturedRequest", "decode_request", "planned_on", "stream_error_event"]


@dataclass(frozen=True, slots=True)
class CapturedRequest:
    """One captured request, decoded: what admission plans and what vLLM receives."""

    parsed: ChatBody | CompletionBody
    """What admission plans (a Messages or Responses request as its chat request)."""
    planned_kind: str
    """``"chat"`` or ``"completion"``: how the call is planned and indexed as a parent."""
    body: bytes
    """The body vLLM's handler receives."""
    request_id: str | None
    """The id vLLM makes the response id of, when the client chose it (checked)."""
    parent: GateCall | None = None
    """The parent the request named itself (``previous_response_id``)."""
    thread: ResponsesTurn | None = None
    structured_outputs: Any = None
    """vLLM's ``StructuredOutputsParams`` the engine call is constrained by, where the API's
    own request has no field for it (Messages: the tokcap extension, `_messages`)."""


async def decode_request(
    kind: str,
    body: bytes,
    *,
    app_state: Any,
    book: RolloutBook,
    rollout_id: str,
    token_ids_allowed: bool,
    header_request_id: str | None,
) -> CapturedRequest:
    """Decode and check ``body`` of a captured ``kind`` request (typed errors, module doc).

    The request id: chat and completions take the ``X-Request-Id`` header over the body's
    ``request_id``; a Messages answer's id is made of the header alone (vLLM builds its chat
    request without the body's), a Responses answer's of the body's ``request_id`` alone.
    """
    if kind == "messages":
        handler = getattr(app_state, "anthropic_serving_messages", None)
        converted = await messages_request(body, handler)
        return CapturedRequest(
            converted.chat,
            "chat",
            body,
            _checked(header_request_id, kind),
            structured_outputs=converted.structured_outputs,
        )
    if kind == "responses":
        if getattr(app_state, "openai_serving_responses", None) is None:
            raise Unsupported("responses_unavailable", "this server does not serve /v1/responses")
        renderer = getattr(app_state, "online_renderer", None)
        made = responses_request(
            body,
            book=book,
            rollout_id=rollout_id,
            harmony=bool(getattr(renderer, "use_harmony", False)),
            exclude_tools_when_tool_choice_none=bool(
                getattr(renderer, "exclude_tools_when_tool_choice_none", False)
            ),
        )
        return CapturedRequest(
            made.chat,
            "chat",
            made.body,
            _checked(made.request_id, kind),
            parent=made.parent,
            thread=made.turn,
        )
    parsed = decode_body(body, kind, token_ids_allowed=token_ids_allowed)
    chosen = header_request_id if header_request_id is not None else parsed.request_id
    return CapturedRequest(parsed, kind, body, _checked(chosen, kind))


def _checked(request_id: str | None, kind: str) -> str | None:
    return None if request_id is None else check_request_id(request_id, kind)


def planned_on(planned: PlannedRequest, parent: GateCall | None) -> PlannedRequest:
    """``planned``, resolved against ``parent`` alone when the request named its parent (no
    other call of the rollout is considered; if the named parent's turn does not match,
    the call is a new root with its break cause)."""
    if parent is None:
        return planned
    inner, named = planned.plan, parent.call_id

    def plan(priors: Any, gen_starts: Any) -> Any:
        return inner([p for p in priors if p.call_id == named], gen_starts)

    return replace(planned, plan=plan)


def stream_error_event(kind: str, code: str, message: str, status: int) -> bytes:
    """The event that ends a captured stream with the gate's typed error.

    OpenAI clients raise on a ``data:`` event holding ``error``; the Anthropic client only
    on an ``event: error`` (it skips events without a name).
    """
    data = error_json(code, message, status)
    if kind == "messages":
        return b"event: error\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"
