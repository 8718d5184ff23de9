"""Binding one captured request to the engine's tokenizer and chat template (a `PlannedRequest`).

vLLM renders the request itself after the gate admitted it; the gate renders it first, the
same way (the server's chat template, or the request's when the server trusts request
templates, with the server's default template kwargs under the request's), to find the
parent and form the exact prompt ids. Everything that can go wrong here is the request's
fault and is refused with a typed 400 before anything reaches the ledger:
``chat_template_not_trusted``, ``bad_chat_template_kwargs`` (keys the gate sets itself),
``bad_chat_template`` (a template that does not render, or that the sandbox refuses) and
``prompt_too_long`` (more characters than the model's context could hold at
``GateConfig.max_chars_per_token``; bounded before any tokenising); for a model that takes
images, an image that does not decode (``bad_image``) or is too large (``media_too_large``:
`_images`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, Protocol

from ...errors import BadRequest, Unsupported
from ...fingerprints import content_chars, image_digests, normalize_message
from .._vllm import require_vllm
from .._wire import ChatBody, CompletionBody
from ._images import ImageCheck
from ._index import PlannedRequest, Planner
from ._plan_text import ChatPlan, PriorCall, plan_chat, plan_completion
from ._splice import SpliceRules

__all__ = ["RenderSettings", "RequestRenderer"]

_RESERVED_KWARGS: Final = frozenset(
    {"tokenize", "add_generation_prompt", "chat_template", "tools", "conversation", "messages"}
)


class RenderSettings(Protocol):
    """What a renderer reads of the gate's configuration (`GateConfig` is one)."""

    @property
    def max_chars_per_token(self) -> int: ...
    @property
    def reasoning_markers(self) -> tuple[str, ...]: ...
    @property
    def on_render_mismatch(self) -> Literal["splice", "break"]: ...
    @property
    def reasoning(self) -> Literal["follow_template", "keep_model_tokens"]: ...


class RequestRenderer:
    """Per server: the engine's tokenizer, the server's template and its template options."""

    def __init__(self, tokenizer: Any, app_args: Any, config: RenderSettings, max_model_len: int):
        self.tokenizer = tokenizer
        self.config = config
        self.max_chars = max_model_len * config.max_chars_per_token
        self.trust_request_templates = bool(getattr(app_args, "trust_request_chat_template", False))
        self.default_kwargs: dict[str, Any] = dict(
            getattr(app_args, "default_chat_template_kwargs", None) or {}
        )
        configured = getattr(app_args, "chat_template", None)
        if configured is not None:
            chat_utils = require_vllm("vllm.renderers.chat_utils")
            configured = chat_utils.load_chat_template(configured)
        self.template: str | None = configured
        self.takes_images = False
        """Whether the served model takes images (set by the server; else any image part is
        refused ``unsupported_content``)."""
        self.images = ImageCheck()
        self.rules = SpliceRules(
            markers=config.reasoning_markers,
            special_texts=_special_texts(tokenizer),
            on_render_mismatch=config.on_render_mismatch,
            reasoning=config.reasoning,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (the template wrote them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def request(self, parsed: ChatBody | CompletionBody) -> PlannedRequest:
        """``parsed`` bound to this server: how to plan it and how to read its output."""
        messages, plan = self.planner(parsed)
        tokenizer = self.tokenizer

        def decode(ids: Sequence[int]) -> str:
            text: str = tokenizer.decode(list(ids), skip_special_tokens=False)
            return text

        images = image_digests(messages) if messages and self.takes_images else ()
        return PlannedRequest(messages, plan, decode, images)

    def planner(
        self, parsed: ChatBody | CompletionBody
    ) -> tuple[list[dict[str, Any]] | None, Planner]:
        """``(normalised messages, plan(priors, gen_starts) -> ChatPlan)`` for one request."""
        if isinstance(parsed, CompletionBody):
            prompt = parsed.prompt
            if isinstance(prompt, str):
                self._check_size(len(prompt))
            encode = self.encode
            return None, lambda priors, _: plan_completion(prompt, priors=priors, encode=encode)
        if parsed.mm_processor_kwargs:
            raise BadRequest(
                "mm_processor_kwargs_refused",
                "per-request mm_processor_kwargs are not captured (the processor fingerprint "
                "binds the server's)",
            )
        messages = [normalize_message(m) for m in parsed.messages]
        if image_digests(messages):
            if not self.takes_images:
                raise BadRequest("unsupported_content", "the served model takes no images")
            self.images.check(parsed.messages)
        self._check_size(
            sum(content_chars(m["content"]) for m in messages) + len(json.dumps(parsed.tools or []))
        )
        render = self._renderer(parsed)
        rules = self.rules
        add_generation_prompt = parsed.add_generation_prompt
        encode = self.encode

        def plan(priors: Sequence[PriorCall], gen_starts: Mapping[str, int]) -> ChatPlan:
            return plan_chat(
                messages,
                priors=priors,
                gen_starts=gen_starts,
                render=render,
                encode=encode,
                add_generation_prompt=add_generation_prompt,
                rules=rules,
            )

        return messages, plan

    def _check_size(self, chars: int) -> None:
        if chars > self.max_chars:
            raise BadRequest(
                "prompt_too_long",
                f"the prompt has {chars} characters; the model's context holds at most about "
                f"{self.max_chars} (GateConfig.max_chars_per_token)",
            )

    def _renderer(self, parsed: ChatBody) -> Any:
        request_kwargs = dict(parsed.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_KWARGS.intersection(request_kwargs))
        requested = parsed.chat_template is not None or "chat_template" in request_kwargs
        if requested and not self.trust_request_templates:
            raise BadRequest(
                "chat_template_not_trusted",
                "this server does not accept chat templates in requests "
                "(--trust-request-chat-template is not set)",
            )
        if reserved:
            raise BadRequest(
                "bad_chat_template_kwargs",
                f"chat_template_kwargs may not set {', '.join(reserved)} (the gate sets them)",
            )
        kwargs = {**self.default_kwargs, **request_kwargs}
        template = parsed.chat_template if parsed.chat_template is not None else self.template
        tools = parsed.tools
        tokenizer = self.tokenizer

        def render(msgs: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
            try:
                text = tokenizer.apply_chat_template(
                    [dict(m) for m in msgs],
                    tools=tools,
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
            except (BadRequest, Unsupported):
                raise
            except Exception as e:  # jinja2's TemplateError, SecurityError, a bad kwarg, ...
                raise BadRequest(
                    "bad_chat_template",
                    f"the chat template did not render: {type(e).__name__}: {str(e)[:200]}",
                ) from e
            if not isinstance(text, str):
                raise BadRequest("bad_chat_template", "the chat template did not render to text")
            return text

        return render


def _special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens: the text vLLM returns to harnesses leaves them out."""
    texts = getattr(tokenizer, "all_special_tokens", None) or ()
    return tuple(sorted({t for t in texts if isinstance(t, str) and t}))
