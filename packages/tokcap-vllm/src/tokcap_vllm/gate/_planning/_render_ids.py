"""Requests for a tokenizer that renders them straight to token ids: vLLM's ``MistralTokenizer``.

In ``--tokenizer-mode mistral`` vLLM renders a chat request with ``mistral_common``
(``MistralTokenizer.apply_chat_template`` returns ids; there is no text template). The
gate renders it the same way (the same call on the engine's own tokenizer, with the
tool-call ids truncated and the tools validated as vLLM does) and plans at the token
level (`_plan_ids`). ``mistral_common`` refuses to serve a conversation
that ends on an assistant message, so the parent's turn is encoded as training data is:
the same instruct tokenizer behind a ``finetuning`` validator, which closes the turn with
``</s>``.

What cannot be captured is refused before anything reaches the ledger:
``tokenizer_unsupported`` (`UnsupportedTokenizer`, at the first captured call and every
later one) when a probe conversation shows the tokenizer cannot plan a follow-up turn, or
for versions that render request fields the gate does not read (v15+
``reasoning_effort``); ``chat_template_unsupported`` for a request carrying a chat template
(vLLM refuses those for Mistral tokenizers too); ``bad_messages`` when ``mistral_common``
refuses the conversation itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from ...errors import BadRequest, Unsupported, UnsupportedTokenizer
from ...fingerprints import content_chars, image_digests, normalize_message
from .._vllm import require_vllm
from .._wire import ChatBody, CompletionBody
from ._index import Planner
from ._plan_ids import plan_chat_ids
from ._plan_text import ChatPlan, PriorCall
from ._render_text import RenderSettings, RequestRenderer

__all__ = [
    "IdRequestRenderer",
    "MistralCodec",
    "is_id_tokenizer",
    "probe_follow_up",
    "request_renderer",
]

_TOOL_CALL_ID_LEN: Final = 9
_PROBE_TOOLS: Final = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe of the tokenizer.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
_PROBE_CALL: Final = {
    "id": "probe0001",
    "type": "function",
    "function": {"name": "probe", "arguments": '{"q": "x"}'},
}


def is_id_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders chat requests to ids (vLLM marks its Mistral tokenizer)."""
    return bool(getattr(type(tokenizer), "IS_MISTRAL_TOKENIZER", False))


def describe(tokenizer: Any) -> str:
    """A tokenizer's name for error messages, e.g. ``MistralTokenizer (Tekkenizer v3)``."""
    inner = getattr(tokenizer, "tokenizer", None)
    version = getattr(getattr(inner, "version", None), "value", None)
    if inner is None or version is None:
        return type(tokenizer).__name__
    return f"{type(tokenizer).__name__} ({type(inner).__name__} {version})"


class MistralCodec:
    """The encodings the id-level planner needs, made the way vLLM's mistral mode makes them."""

    def __init__(self, tokenizer: Any) -> None:
        from mistral_common.protocol.instruct.normalize import get_normalizer
        from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.tokenizer = tokenizer
        self.name = describe(tokenizer)
        instruct = tokenizer.mistral.instruct_tokenizer
        inner = instruct.tokenizer
        self.version = int(tokenizer.version)
        self._history = MistralTokenizer(
            instruct,
            validator=get_validator(inner.version, mode=ValidationMode.finetuning),
            request_normalizer=get_normalizer(inner.version, inner.model_settings_builder),
        )
        self.end_of_turn: int = int(tokenizer.eos_token_id)
        self.special_ids: frozenset[int] = frozenset(tokenizer.all_special_ids)

    def request(self, messages: Sequence[dict[str, Any]], tools: Any) -> list[int]:
        """``messages`` as vLLM serves them (ends on a user or tool message)."""
        return list(self.tokenizer.apply_chat_template(list(messages), tools=tools))

    def history(self, messages: Sequence[dict[str, Any]], tools: Any) -> list[int]:
        """``messages``, ending on an assistant message, closed as training data is."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        request = ChatCompletionRequest.from_openai(messages=list(messages), tools=tools)
        return list(self._history.encode_chat_completion(request).tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without control tokens (the planner compares those by id)."""
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text


def probe_follow_up(codec: MistralCodec) -> str | None:
    """Why follow-up turns cannot be planned with ``codec`` (None: they can).

    Two probe conversations, one plain and one with a tool call: the assistant turn must
    encode as the served request plus a turn closed by the end-of-turn token, and the next
    request must start with that history. A tokenizer that does not serve tool
    conversations (v1) passes: such requests get its own refusal, as they would from vLLM.
    """
    if codec.version >= 15:
        return "it renders reasoning_effort into the prompt, a field the gate does not read"
    user: dict[str, Any] = {"role": "user", "content": "Hello"}
    plain = (
        [user],
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Again"},
        None,
    )
    tool = (
        [user],
        {"role": "assistant", "content": None, "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": "ok"},
        _PROBE_TOOLS,
    )
    for before, turn, after, tools in (plain, tool):
        try:
            served = codec.request(before, tools)
            follow = codec.request([*before, turn, after], tools)
        except Exception as e:
            if tools is not None:
                continue  # it does not serve tool conversations at all (nor would vLLM)
            return f"it refused a probe request ({type(e).__name__}: {str(e)[:160]})"
        try:
            closed = codec.history([*before, turn], tools)
        except Exception as e:  # it serves the follow-up but cannot close the turn before it
            return f"it cannot encode a finished turn ({type(e).__name__}: {str(e)[:160]})"
        if closed[: len(served)] != served or not closed or closed[-1] != codec.end_of_turn:
            return "an assistant turn does not extend the request it answers"
        if follow[: len(closed)] != closed:
            return "a follow-up request does not extend the conversation before it"
    return None


class IdRequestRenderer(RequestRenderer):
    """Per server: a tokenizer that renders requests to ids, and its checked codec."""

    def __init__(self, tokenizer: Any, app_args: Any, config: RenderSettings, max_model_len: int):
        super().__init__(tokenizer, app_args, config, max_model_len)
        self.codec = MistralCodec(tokenizer)
        problem = probe_follow_up(self.codec)
        if problem is not None:
            raise UnsupportedTokenizer(
                "tokenizer_unsupported",
                f"captured calls cannot be planned with {self.codec.name}: {problem}",
            )
        self.splice = config.on_render_mismatch == "splice"

    def planner(
        self, parsed: ChatBody | CompletionBody
    ) -> tuple[list[dict[str, Any]] | None, Planner]:
        """``(normalised messages, plan(priors, gen_starts) -> ChatPlan)`` for one request."""
        if isinstance(parsed, CompletionBody):
            return super().planner(parsed)
        if parsed.chat_template is not None or parsed.chat_template_kwargs is not None:
            raise Unsupported(
                "chat_template_unsupported",
                f"{self.codec.name} renders requests itself; a chat template cannot be applied",
            )
        messages = [normalize_message(m) for m in parsed.messages]
        if image_digests(messages):
            raise BadRequest(
                "unsupported_content", "images are captured only with chat-template tokenizers"
            )
        self._check_size(
            sum(content_chars(m["content"]) for m in messages) + len(json.dumps(parsed.tools or []))
        )
        raw = [_served_message(m) for m in parsed.messages]
        tools = _served_tools(parsed.tools)
        codec, splice = self.codec, self.splice

        def request(n: int) -> list[int]:
            return _refusing(codec.request, raw[:n], tools)

        def history(n: int) -> list[int] | None:
            try:
                return codec.history(raw[:n], tools)
            except Exception:  # served, yet not encodable as a finished conversation: a break
                return None

        def plan(priors: Sequence[PriorCall], gen_starts: Any) -> ChatPlan:
            return plan_chat_ids(
                messages,
                priors=priors,
                request=request,
                history=history,
                end_of_turn=codec.end_of_turn,
                special_ids=codec.special_ids,
                decode=codec.decode,
                splice=splice,
            )

        return messages, plan


def _refusing(encode: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    try:
        ids: list[int] = encode(messages, tools)
    except (BadRequest, Unsupported):
        raise
    except Exception as e:  # mistral_common's validation errors, assertions, pydantic's
        raise BadRequest(
            "bad_messages",
            f"the Mistral tokenizer refused the messages: {type(e).__name__}: {str(e)[:200]}",
        ) from e
    return ids


def _served_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message as vLLM hands it to the tokenizer: tool-call ids cut to their last 9."""
    out = dict(message)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_short_call_id(c) for c in calls]
    call_id = out.get("tool_call_id")
    if isinstance(call_id, str) and len(call_id) > _TOOL_CALL_ID_LEN:
        out["tool_call_id"] = call_id[-_TOOL_CALL_ID_LEN:]
    return out


def _short_call_id(call: Any) -> Any:
    call_id = call.get("id") if isinstance(call, dict) else None
    if isinstance(call_id, str) and len(call_id) > _TOOL_CALL_ID_LEN:
        return {**call, "id": call_id[-_TOOL_CALL_ID_LEN:]}
    return call


def _served_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as vLLM hands them to the tokenizer (validated by its own model, dumped)."""
    if tools is None:
        return None
    protocol = require_vllm("vllm.entrypoints.openai.chat_completion.protocol")
    try:
        return [protocol.ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]
    except ValueError as e:  # pydantic's ValidationError
        raise BadRequest("bad_body", f"invalid tools: {str(e)[:200]}") from e


def request_renderer(
    tokenizer: Any, app_args: Any, config: RenderSettings, max_model_len: int
) -> RequestRenderer:
    """The renderer for this server's tokenizer: the one place its kind chooses the planner.

    Text chat templates get `RequestRenderer` (parent resolution and splicing on rendered
    text); a tokenizer that renders requests straight to ids (vLLM's ``MistralTokenizer``)
    gets the id-level planner (`IdRequestRenderer`), which raises `UnsupportedTokenizer`
    when follow-up turns cannot be planned with it.
    """
    if is_id_tokenizer(tokenizer):
        return IdRequestRenderer(tokenizer, app_args, config, max_model_len)
    return RequestRenderer(tokenizer, app_args, config, max_model_len)
