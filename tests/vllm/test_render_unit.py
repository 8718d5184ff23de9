"""Binding a request to the engine's tokenizer, with real tokenizers and templates, no engine.

The server's renderer (`request_renderer`) renders a request as vLLM will: the server's
chat template (a file or the text itself), or the request's when the server trusts request
templates, with the server's default template kwargs under the request's. What it refuses
is the request's fault, answered 400 before anything reaches the ledger:
``chat_template_not_trusted``, ``bad_chat_template_kwargs``, ``bad_chat_template``,
``prompt_too_long`` (more characters than ``max_model_len * max_chars_per_token``). A
tokenizer that renders requests to ids (vLLM's ``MistralTokenizer``) gets the id-level
renderer, which probes that follow-up turns can be planned with it and refuses chat
templates (``chat_template_unsupported``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from tests.vllm._tokenizers import chatml_tokenizer, mistral_tokenizer
from tokcap.tiny import CHATML_TEMPLATE, VLM_CHAT_TEMPLATE
from tokcap_vllm import GateConfig
from tokcap_vllm.errors import BadRequest, Unsupported
from tokcap_vllm.gate._planning import (
    ChatPlan,
    IdRequestRenderer,
    RequestRenderer,
    request_renderer,
)
from tokcap_vllm.gate._planning._render_ids import describe
from tokcap_vllm.gate._wire import decode_body

PREAMBLE_TEMPLATE = "{{- preamble ~ '|' }}" + CHATML_TEMPLATE
"""ChatML after a ``preamble`` template kwarg (as templates read ``enable_thinking``)."""
HI = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer()


def _server(tokenizer: Any, max_model_len: int = 4096, **app_args: Any) -> RequestRenderer:
    config = GateConfig(max_chars_per_token=app_args.pop("max_chars_per_token", 32))
    return request_renderer(tokenizer, SimpleNamespace(**app_args), config, max_model_len)


def _chat(**body: Any) -> Any:
    return decode_body(
        json.dumps({"messages": HI, **body}).encode(), "chat", token_ids_allowed=True
    )


def _plan(renderer: RequestRenderer, parsed: Any) -> ChatPlan:
    return renderer.request(parsed).plan([], {})


def _refused(renderer: RequestRenderer, parsed: Any) -> str:
    with pytest.raises((BadRequest, Unsupported)) as refused:
        _plan(renderer, parsed)
    return refused.value.code


# ---- which template, with which kwargs --------------------------------------------------------


def test_the_servers_template_file_is_read_as_vllm_reads_it(tokenizer: Any, tmp_path: Any) -> None:
    path = tmp_path / "template.jinja"
    path.write_text("FILE|" + CHATML_TEMPLATE)
    plan = _plan(_server(tokenizer, chat_template=str(path)), _chat())
    assert plan.prompt_text == "FILE|<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert plan.prompt_ids == tokenizer.encode(plan.prompt_text, add_special_tokens=False)


def test_without_a_server_template_the_tokenizers_own_renders(tokenizer: Any) -> None:
    for app_args in (None, SimpleNamespace()):
        renderer = request_renderer(tokenizer, app_args, GateConfig(), 4096)
        assert _plan(renderer, _chat()).prompt_text == tokenizer.apply_chat_template(
            HI, tokenize=False, add_generation_prompt=True
        )


def test_the_requests_template_kwargs_override_the_servers_defaults(tokenizer: Any) -> None:
    server = _server(
        tokenizer, chat_template=PREAMBLE_TEMPLATE, default_chat_template_kwargs={"preamble": "A"}
    )
    assert _plan(server, _chat()).prompt_text.startswith("A|<|im_start|>user")
    mine = _chat(chat_template_kwargs={"preamble": "B"})
    assert _plan(server, mine).prompt_text.startswith("B|<|im_start|>user")


def test_a_trusting_server_renders_a_requests_own_template_and_its_own_otherwise(
    tokenizer: Any,
) -> None:
    server = _server(
        tokenizer, chat_template="SERVER|" + CHATML_TEMPLATE, trust_request_chat_template=True
    )
    assert _plan(server, _chat()).prompt_text.startswith("SERVER|<|im_start|>user")
    mine = _chat(chat_template="MINE|" + CHATML_TEMPLATE)
    assert _plan(server, mine).prompt_text.startswith("MINE|<|im_start|>user")


@pytest.mark.parametrize(
    "body",
    [
        {"chat_template": CHATML_TEMPLATE},
        {"chat_template_kwargs": {"chat_template": CHATML_TEMPLATE}},
        {"chat_template": CHATML_TEMPLATE, "chat_template_kwargs": {"x": 1}},
    ],
    ids=["field", "kwarg", "both"],
)
def test_a_request_template_is_refused_unless_the_server_trusts_request_templates(
    tokenizer: Any, body: dict[str, Any]
) -> None:
    assert _refused(_server(tokenizer), _chat(**body)) == "chat_template_not_trusted"
    assert _plan(_server(tokenizer), _chat(chat_template_kwargs={"x": 1})).parent_id is None


@pytest.mark.parametrize(
    "kwarg", ["tokenize", "add_generation_prompt", "tools", "conversation", "messages"]
)
def test_template_kwargs_the_gate_sets_itself_are_refused(tokenizer: Any, kwarg: str) -> None:
    parsed = _chat(chat_template_kwargs={kwarg: True})
    assert _refused(_server(tokenizer), parsed) == "bad_chat_template_kwargs"


@pytest.mark.parametrize(
    "template", ["{{ raise_exception('no') }}", "{% for %}", "{{ messages[0].content.x.y }}"]
)
def test_a_template_that_does_not_render_is_a_bad_chat_template(
    tokenizer: Any, template: str
) -> None:
    server = _server(tokenizer, trust_request_chat_template=True)
    assert _refused(server, _chat(chat_template=template)) == "bad_chat_template"


# ---- the size bound, before any tokenising ----------------------------------------------------


def test_a_chat_prompt_over_the_context_bound_is_refused_and_one_at_it_is_planned(
    tokenizer: Any,
) -> None:
    """8 tokens of at most 4 characters: 32 characters of content plus the tools' JSON
    (``[]`` when there are none)."""
    server = _server(tokenizer, max_model_len=8, max_chars_per_token=4)

    def chat(content: str, tools: Any = None) -> Any:
        body = {"messages": [{"role": "user", "content": content}], "tools": tools}
        return decode_body(json.dumps(body).encode(), "chat", token_ids_allowed=True)

    assert _plan(server, chat("x" * 30)).prompt_text.endswith("assistant\n")
    assert _refused(server, chat("x" * 31)) == "prompt_too_long"
    tools = [{"type": "function", "function": {"name": "f"}}]
    size = len(json.dumps([{"type": "function", "function": {"name": "f"}}]))
    assert _refused(server, chat("x" * (33 - size), tools)) == "prompt_too_long"


def test_a_text_completion_over_the_context_bound_is_refused(tokenizer: Any) -> None:
    server = _server(tokenizer, max_model_len=8, max_chars_per_token=4)

    def completion(prompt: Any) -> Any:
        raw = json.dumps({"prompt": prompt}).encode()
        return decode_body(raw, "completion", token_ids_allowed=True)

    assert _plan(server, completion("y" * 32)).prompt_ids == tokenizer.encode(
        "y" * 32, add_special_tokens=False
    )
    assert _refused(server, completion("y" * 33)) == "prompt_too_long"
    assert _plan(server, completion([5] * 64)).prompt_ids == [5] * 64  # ids are not characters


# ---- what the splice rules know of the tokenizer ---------------------------------------------


def test_the_splice_rules_know_the_tokenizers_special_tokens_and_the_gates_choices(
    tokenizer: Any,
) -> None:
    config = GateConfig(reasoning="keep_model_tokens", reasoning_markers=("<r>",))
    rules = request_renderer(tokenizer, None, config, 4096).rules
    assert rules.special_texts == ("<|endoftext|>", "<|im_end|>", "<|im_start|>")
    assert (rules.markers, rules.reasoning, rules.on_render_mismatch) == (
        ("<r>",),
        "keep_model_tokens",
        "splice",
    )


def test_only_non_empty_text_is_a_special_text() -> None:
    """A stand-in tokenizer (the real ones list only text): what is not text is left out."""
    odd = SimpleNamespace(all_special_tokens=["<b>", "", None, "<a>", "<b>"])
    assert request_renderer(odd, None, GateConfig(), 8).rules.special_texts == ("<a>", "<b>")
    assert request_renderer(SimpleNamespace(), None, GateConfig(), 8).rules.special_texts == ()


def test_a_call_is_read_back_with_its_special_tokens(tokenizer: Any) -> None:
    request = _server(tokenizer).request(_chat())
    ids = tokenizer.encode("yes<|im_end|>", add_special_tokens=False)
    assert request.decode(ids) == "yes<|im_end|>"


# ---- tokenizers that render requests to ids (vLLM's MistralTokenizer) -------------------------


def test_a_mistral_tokenizer_gets_the_id_level_renderer_and_a_text_one_the_text_renderer(
    tokenizer: Any,
) -> None:
    mistral = request_renderer(mistral_tokenizer("tekken"), None, GateConfig(), 64)
    assert isinstance(mistral, IdRequestRenderer)
    assert type(request_renderer(tokenizer, None, GateConfig(), 64)) is RequestRenderer


def test_a_tokenizer_that_serves_no_tool_calls_is_served_and_its_tool_calls_refused() -> None:
    """``mistral_common``'s v1 tokenizer has no tool tokens: the follow-up probe skips its
    tool conversation, and a conversation with tool calls is refused as the tokenizer
    refuses it (vLLM would refuse it too)."""
    v1 = request_renderer(mistral_tokenizer("v1"), None, GateConfig(), 4096)
    assert _plan(v1, _chat()).prompt_ids == mistral_tokenizer("v1").apply_chat_template(HI)
    call = {
        "id": "abcdefghi",
        "type": "function",
        "function": {"name": "lookup", "arguments": "{}"},
    }
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "ok"},
    ]
    raw = json.dumps({"messages": messages, "tools": TOOLS}).encode()
    assert _refused(v1, decode_body(raw, "chat", token_ids_allowed=True)) == "bad_messages"


@pytest.mark.parametrize(
    "body", [{"chat_template": "{{ 1 }}"}, {"chat_template_kwargs": {"x": 1}}], ids=str
)
def test_a_mistral_renderer_refuses_any_chat_template_option(body: dict[str, Any]) -> None:
    renderer = request_renderer(mistral_tokenizer("spm"), None, GateConfig(), 4096)
    with pytest.raises(Unsupported) as refused:
        renderer.planner(_chat(**body))
    assert refused.value.code == "chat_template_unsupported"


def test_a_mistral_prompt_over_the_context_bound_is_refused() -> None:
    renderer = request_renderer(
        mistral_tokenizer("spm"), None, GateConfig(max_chars_per_token=4), 8
    )

    def chat(content: str) -> Any:
        body = {"messages": [{"role": "user", "content": content}]}
        return decode_body(json.dumps(body).encode(), "chat", token_ids_allowed=True)

    assert _plan(renderer, chat("x" * 30)).parent_id is None
    assert _refused(renderer, chat("x" * 31)) == "prompt_too_long"


def test_a_tokenizer_is_named_by_its_type_and_its_inner_tokenizer_when_it_has_one(
    tokenizer: Any,
) -> None:
    assert describe(mistral_tokenizer("tekken")) == "MistralTokenizer (Tekkenizer v3)"
    assert describe(mistral_tokenizer("v1")) == "MistralTokenizer (SentencePieceTokenizer v1)"
    assert describe(tokenizer) == type(tokenizer).__name__
    unversioned = SimpleNamespace(tokenizer=object())  # a wrapper whose inner has no version
    assert describe(unversioned) == "SimpleNamespace"


# ---- images ---------------------------------------------------------------------------------

_PNG_1X1 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5Erk"
    "Jggg=="
)
_IMAGE = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_PNG_1X1}"}}


def test_images_are_refused_on_a_model_without_them_and_planned_on_one_with_them(
    tokenizer: Any,
) -> None:
    parsed = _chat(messages=[{"role": "user", "content": [_IMAGE, {"type": "text", "text": "x"}]}])
    assert _refused(_server(tokenizer), parsed) == "unsupported_content"
    renderer = _server(tokenizer, chat_template=VLM_CHAT_TEMPLATE)
    renderer.takes_images = True
    plan = _plan(renderer, parsed)
    assert plan.parent_id is None
    assert plan.prompt_ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    # a template that only concatenates string content cannot render image parts
    assert _refused(_with_images(_server(tokenizer)), parsed) == "bad_chat_template"


def _with_images(renderer: RequestRenderer) -> RequestRenderer:
    renderer.takes_images = True
    return renderer


def test_per_request_mm_processor_kwargs_are_refused(tokenizer: Any) -> None:
    renderer = _server(tokenizer)
    renderer.takes_images = True
    parsed = _chat(mm_processor_kwargs={"size": {"longest_edge": 64}})
    assert _refused(renderer, parsed) == "mm_processor_kwargs_refused"


def test_an_id_level_tokenizer_refuses_images() -> None:
    renderer = _server(mistral_tokenizer("tekken"))
    parsed = _chat(messages=[{"role": "user", "content": [_IMAGE]}])
    assert _refused(renderer, parsed) == "unsupported_content"
