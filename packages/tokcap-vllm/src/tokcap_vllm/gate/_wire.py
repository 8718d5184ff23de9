"""Wire structs (msgspec): the request fields the gate reads and the response fields it watches."""

from __future__ import annotations

import json
from typing import Any, Final, TypeVar

import msgspec

from ..errors import BadRequest, GateError, Unsupported
from ._answers import ApiAnswer, answer_reader

__all__ = [
    "ChatBody",
    "CompletionBody",
    "ResponseObserver",
    "chat_body",
    "check_request_id",
    "decode_body",
    "decode_json",
    "decode_object",
]

_S = TypeVar("_S")

RESPONSE_ID_PREFIXES: Final = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "messages": "chatcmpl-",
    "responses": "",
}
"""What vLLM puts before a request id to make the response id the ledger records (a
Messages answer keeps the id of the chat completion vLLM made of it; a Responses answer's
id is its body's ``request_id``)."""
_MAX_LABEL: Final = 256  # tokcap_core's bound on a response id (1..256 printable ASCII)


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields both request kinds share (others pass through to vLLM)."""

    n: int | None = None
    best_of: int | None = None
    stream: bool | None = False
    use_beam_search: bool = False
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    seed: int | None = None
    truncate_prompt_tokens: int | None = None


class ChatBody(_Sampling, kw_only=True):
    """The chat-completion request fields admission needs (others pass through to vLLM)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None


class CompletionBody(_Sampling, kw_only=True):
    """The completion request fields admission needs."""

    prompt: str | list[Any]
    echo: bool | None = False


def decode_json(raw: bytes, kind: type[_S], what: str, invalid: type[GateError] = BadRequest) -> _S:
    """``raw`` decoded as ``kind``; a body that is no JSON is `BadRequest` ``bad_json``, one
    that does not fit ``kind`` is ``invalid`` ``bad_body`` (``what`` names it in messages)."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise invalid("bad_body", f"invalid {what}: {e}") from e
    except msgspec.DecodeError as e:
        raise BadRequest("bad_json", f"{what} is not JSON: {e}") from e
    except RecursionError as e:
        raise BadRequest("bad_json", f"{what} is nested too deeply") from e
    except UnicodeDecodeError as e:
        raise BadRequest("bad_json", f"{what} is not valid UTF-8") from e


def decode_body(body: bytes, kind: str, *, token_ids_allowed: bool) -> ChatBody | CompletionBody:
    """Decode and check a captured request body; `BadRequest` / `Unsupported` with a code.

    ``token_ids_allowed`` is ``CaptureConfig.return_token_ids``: without it a request
    asking for token ids is refused (``token_ids_not_allowed``).
    """
    target: type[ChatBody] | type[CompletionBody] = ChatBody if kind == "chat" else CompletionBody
    parsed = decode_json(body, target, "request body")
    if parsed.n not in (None, 1) or parsed.best_of not in (None, 1):
        raise Unsupported(
            "n_unsupported", "captured rollouts take n=1 (one completion per call); send n calls"
        )
    if parsed.truncate_prompt_tokens is not None:
        raise Unsupported(
            "truncate_prompt_tokens_unsupported",
            "a captured call runs on the exact ids the gate admitted; truncating the prompt "
            "would cut the rollout's history (send a shorter conversation instead)",
        )
    if parsed.use_beam_search:
        raise Unsupported("beam_search_unsupported", "beam search cannot be captured")
    if (parsed.return_token_ids or parsed.return_tokens_as_token_ids) and not token_ids_allowed:
        raise Unsupported(
            "token_ids_not_allowed",
            "this gate does not return token ids to harnesses (CaptureConfig.return_token_ids)",
        )
    if isinstance(parsed, ChatBody):
        if not parsed.messages:
            raise BadRequest("bad_body", "messages must not be empty")
        if parsed.continue_final_message:
            raise Unsupported(
                "continue_final_message_unsupported", "continue_final_message cannot be captured"
            )
    else:
        if isinstance(parsed.prompt, list) and not all(
            type(t) is int and t >= 0 for t in parsed.prompt
        ):
            raise Unsupported(
                "batched_prompt_unsupported", "one prompt (text or token ids) per captured call"
            )
        if not parsed.prompt:
            raise BadRequest("bad_body", "prompt must not be empty")
        if parsed.echo:
            raise Unsupported("echo_unsupported", "echo cannot be captured")
    return parsed


def decode_object(body: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object (`BadRequest` ``bad_json``/``bad_body``)."""
    try:
        raw = json.loads(body)
    except RecursionError as e:
        raise BadRequest("bad_json", "request body is nested too deeply") from e
    except ValueError as e:  # UnicodeDecodeError included
        raise BadRequest("bad_json", f"request body is not JSON: {str(e)[:200]}") from e
    if not isinstance(raw, dict):
        raise BadRequest("bad_body", "the request body must be a JSON object")
    return raw


def chat_body(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    reasoning_effort: str | None,
    stream: bool,
    seed: int | None = None,
) -> ChatBody:
    """The chat request vLLM made of a Messages or Responses request, as admission reads it.

    A reasoning effort reaches the template as vLLM passes it (``reasoning_effort``, and
    ``enable_thinking`` unless the request set it); an empty conversation is refused.
    """
    kwargs = dict(template_kwargs or {})
    if reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", reasoning_effort != "none")
        kwargs["reasoning_effort"] = reasoning_effort
    if not messages:
        raise BadRequest("bad_body", "the request holds no message")
    return ChatBody(
        messages=[dict(m) for m in messages],
        stream=stream,
        tools=[dict(t) for t in tools] if tools else None,
        chat_template_kwargs=kwargs or None,
        seed=seed,
    )


def check_request_id(request_id: str, kind: str) -> str:
    """The request id vLLM will use, if the ledger can store the response id it makes.

    vLLM answers with ``{prefix}{request_id}`` as the response id (an ``X-Request-Id``
    header wins over the body's ``request_id``, even an empty one); the ledger stores
    response ids of 1..256 printable ASCII characters. Anything else is refused here, before
    admission (`BadRequest` ``bad_request_id``), rather than answered and then refused at
    the commit, which would poison the rollout.
    """
    room = _MAX_LABEL - len(RESPONSE_ID_PREFIXES[kind])
    if not 1 <= len(request_id) <= room or not (request_id.isascii() and request_id.isprintable()):
        raise BadRequest(
            "bad_request_id",
            f"a request id of a captured call is 1..{room} printable ASCII characters "
            f"(got {len(request_id)} characters)",
        )
    return request_id


class _ToolDelta(msgspec.Struct):
    index: int = 0
    function: dict[str, Any] | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolDelta] | None = None


class _Choice(msgspec.Struct):
    message: _Message | None = None
    delta: _Message | None = None
    text: str | None = None


class _Response(msgspec.Struct):
    id: str | None = None
    choices: list[_Choice] = []


_decoder = msgspec.json.Decoder(_Response)


class ResponseObserver:
    """Watches a response on its way out: status, id, returned content and tool calls.

    ``kind`` is the captured endpoint: a Messages or Responses answer is read by its
    `tokcap_vllm.gate._answers` reader, whose terminal event (``message_stop``,
    ``response.completed``) ends the stream as ``[DONE]`` ends a chat stream.
    """

    def __init__(self, *, keep: bool, kind: str = "chat") -> None:
        self.api: ApiAnswer | None = answer_reader(kind)
        self.status = 0
        self.start: dict[str, Any] | None = None
        self.streaming = False
        self.chunks: list[bytes] | None = [] if keep else None
        self.response_id: str | None = None
        self.content = ""
        self.tools: dict[int, dict[str, str]] = {}
        self._buffer = b""
        self.done = False
        self.stream_done = False
        """A stream sent its ``data: [DONE]`` event (the harness reads it as a normal end)."""

    def on_start(self, message: dict[str, Any]) -> None:
        """Record the status and whether the body is a server-sent-event stream."""
        self.start = message
        self.status = int(message["status"])
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                self.streaming = True

    def on_body(self, body: bytes) -> None:
        """Feed one body chunk."""
        if self.chunks is not None:
            self.chunks.append(body)
        self._buffer += body
        if self.streaming:
            *events, self._buffer = self._buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    if line[6:].strip() == b"[DONE]":
                        self.stream_done = True
                    else:
                        self._take(line[6:], delta=True)

    def finish(self) -> None:
        """The last chunk arrived: parse a non-streaming body."""
        self.done = True
        if not self.streaming and self.status == 200:
            self._take(self._buffer, delta=False)
        self._buffer = b""
        if self.api is not None:
            self.content = self.api.content()

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The returned tool calls, merged across stream deltas."""
        if self.api is not None:
            return self.api.tool_calls()
        if not self.tools:
            return None
        return [{"type": "function", "function": self.tools[i]} for i in sorted(self.tools)]

    def _take(self, raw: bytes, *, delta: bool) -> None:
        if self.api is not None:
            self._take_api(self.api, raw, delta=delta)
            return
        try:
            response = _decoder.decode(raw)
        except msgspec.DecodeError:
            return
        self.response_id = self.response_id or response.id
        for choice in response.choices[:1]:
            message = choice.delta if delta else choice.message
            if choice.text is not None:
                self.content += choice.text
            if message is None:
                continue
            self.content += message.content or ""
            for position, tool in enumerate(message.tool_calls or ()):
                index = tool.index if delta else position
                slot = self.tools.setdefault(index, {"name": "", "arguments": ""})
                fn = tool.function or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""

    def _take_api(self, api: ApiAnswer, raw: bytes, *, delta: bool) -> None:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            return
        if not isinstance(data, dict):
            return
        if delta:
            api.event(data)
            self.stream_done = self.stream_done or api.done
        else:
            api.whole(data)
        self.response_id = self.response_id or api.response_id
