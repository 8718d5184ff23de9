"""The text planner's rules, on the gate's own path with a real tokenizer and template, no engine.

A `Rollout` plans each call the way the gate does: the request is decoded (`decode_body`),
bound to the tokenizer by the server's renderer (`request_renderer`), planned over the
rollout's parent index (`ParentIndex.planner`), and once "answered" learned as the gate
learns it (`ParentIndex.learn`, then `add` at the end of its rendered prompt). The model's
turn is given as the text it generated (special tokens written out, encoded by the real
tokenizer); the harness receives what vLLM returns (the content with special tokens
skipped) and sends it back in its next request.

The rules (`tokcap_vllm.gate._planning._plan_text`, `_splice`):

- **token_in**: a child's prompt is its parent's exact ids, then the ids of the text the
  template renders after the parent's turn (``extend``), or after the template's own
  close of that turn (``splice``, with its cause);
- the parent is the **deepest** assistant message of the request that names a call's
  conversation (the latest call of equal conversations);
- a **break** makes the call a new root, with its cause: ``no_parent_match``,
  ``history_rewritten``, ``template_unstable``, ``template_mismatch``,
  ``reasoning_stripped``.
"""

from __future__ import annotations

import json
import unicodedata
from array import array
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm._helpers import STRIP_REASONING_TEMPLATE
from tests.vllm._templates import CHATML_TOOLS_TEMPLATE, LLAMA3_TOOLS_TEMPLATE, QWEN3_TEMPLATE
from tests.vllm._tokenizers import chatml_tokenizer, mistral_tokenizer
from tokcap.tiny import CHATML_TEMPLATE
from tokcap_vllm import GateConfig
from tokcap_vllm.extend import EngineResult
from tokcap_vllm.fingerprints import normalize_message
from tokcap_vllm.gate._planning import (
    ChatPlan,
    Observed,
    ParentIndex,
    PlannedRequest,
    request_renderer,
)
from tokcap_vllm.gate._planning._plan_text import plan_chat
from tokcap_vllm.gate._planning._splice import splice_cause
from tokcap_vllm.gate._wire import decode_body

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate a op b.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"a": 1}'}}
UPPER_TEMPLATE = (
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' %}{%- set c = c | upper %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Writes every assistant turn upper-cased: no end-of-turn text can be split off it."""
TOOL_TURN_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- for c in m['tool_calls'] %}"
    "{{- c['function']['name'] + (c['function']['arguments'] | tojson) }}"
    "{%- endfor %}{{- '<|endoftext|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Closes a tool-call turn with another token than a plain turn (as Llama 3's ``<|eom_id|>``)."""
LAST_USER_SYSTEM_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if loop.index0 == ns.last %}{{- '<|im_start|>system\nbe brief<|im_end|>\n' }}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Writes the system prompt before the *last* user message (as Mistral's v3 tokenizers do)."""
TOOLS_HEADER = (
    "{%- if tools %}{{- '<|im_start|>system\n' + (tools | tojson) + '<|im_end|>\n' }}{%- endif %}"
)
"""The tool list first, as a system turn (prepended to the reasoning templates)."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer()


class Rollout:
    """One rollout's calls, planned and learned as the gate plans and learns them."""

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = CHATML_TEMPLATE,
        *,
        tools: list[dict[str, Any]] | None = None,
        config: GateConfig | None = None,
    ) -> None:
        self.tok = tokenizer
        self.tools = tools
        app_args = None if template is None else SimpleNamespace(chat_template=template)
        self.renderer = request_renderer(tokenizer, app_args, config or GateConfig(), 4096)
        self.index = ParentIndex()
        self.plans: list[ChatPlan] = []
        self.cum_ids: list[list[int]] = []

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (special tokens written out are read as those tokens)."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tok.decode(list(ids), skip_special_tokens=False)
        return text

    def request(self, messages: list[dict[str, Any]], **body: Any) -> PlannedRequest:
        raw = json.dumps({"messages": messages, "tools": self.tools, **body}).encode()
        return self.renderer.request(decode_body(raw, "chat", token_ids_allowed=True))

    def plan(self, messages: list[dict[str, Any]], **body: Any) -> ChatPlan:
        """Plan a call of ``messages`` over the calls answered so far (not answered itself)."""
        plan = self.index.planner(self.request(messages, **body))()
        self.plans.append(plan)
        return plan

    def call(
        self, messages: list[dict[str, Any]], generated: str | list[int], **reply: Any
    ) -> dict[str, Any]:
        """Plan a call; the model generates ``generated`` (text or ids); the message the
        harness receives (the content with special tokens skipped, unless ``reply`` says
        what a parser made of it)."""
        request = self.request(messages)
        plan = self.index.planner(request)()
        self.plans.append(plan)
        output = self.encode(generated) if isinstance(generated, str) else generated
        content = self.tok.decode(output, skip_special_tokens=True)
        returned = {"role": "assistant", "content": content, **reply}
        result = EngineResult(
            prompt_ids=plan.prompt_ids,
            output_ids=array("I", output),
            logprobs=array("f", [0.0] * len(output)),
            finish_reason="stop",
            weight_version=0,
            weight_version_last=0,
            text=content,
        )
        seen = Observed(f"resp-{len(self.plans)}", returned["content"], returned.get("tool_calls"))
        call_id = f"c{len(self.plans):06d}"
        learned = ParentIndex.learn(
            request, call_id=call_id, kind="chat", plan=plan, result=result, seen=seen
        )
        self.index.add(learned.prior, len(plan.prompt_text))
        self.cum_ids.append([*plan.prompt_ids, *output])
        return returned

    def answered(self, generated: str, then: str = "b") -> list[dict[str, Any]]:
        """A second request's history: user ``a``, the `call` whose model generated
        ``generated``, user ``then``."""
        messages = [_user("a")]
        return [*messages, self.call(messages, generated), _user(then)]

    def carried(self, plan: ChatPlan) -> str:
        """The text of what a child's prompt carries after its parent's ids."""
        return self.decode(plan.prompt_ids[plan.prefix_len :])


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _on_parent(rollout: Rollout, plan: ChatPlan, parent: int) -> None:
    """``plan`` is a child of call ``parent`` (1-based), on that call's exact ids."""
    assert plan.parent_id == f"c{parent:06d}", (plan.formation, plan.break_cause)
    ids = rollout.cum_ids[parent - 1]
    assert (plan.prefix_len, plan.prompt_ids[: len(ids)]) == (len(ids), ids)


def _root(plan: ChatPlan, cause: str | None, rollout: Rollout) -> None:
    """``plan`` is a new root for ``cause``: the template's rendering of the request, tokenised."""
    assert (plan.parent_id, plan.formation, plan.break_cause) == (None, "root", cause)
    assert (plan.prefix_len, plan.splice_cause) == (0, None)
    assert plan.prompt_ids == rollout.encode(plan.prompt_text)


# ---- token_in: the parent's exact ids, then what the template renders after them ------------


texts = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=24
).filter(
    # the tiny tokenizer normalises NFC: a text it changes cannot come back as generated
    lambda t: t.strip() == t and "<|" not in t and unicodedata.normalize("NFC", t) == t
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(user=texts, answer=texts, follow=texts)
def test_a_child_extends_its_parent_by_the_templates_text_after_the_parents_turn(
    tokenizer: Any, user: str, answer: str, follow: str
) -> None:
    rollout = Rollout(tokenizer)
    messages = [_user(user)]
    messages += [rollout.call(messages, answer + "<|im_end|>"), _user(follow)]
    child = rollout.plan(messages)
    _on_parent(rollout, child, 1)
    assert (child.formation, child.splice_cause, child.break_cause) == ("extend", None, None)
    rendered = f"\n<|im_start|>user\n{follow}<|im_end|>\n<|im_start|>assistant\n"
    assert child.prompt_ids[child.prefix_len :] == rollout.encode(rendered)
    history = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>"
    assert child.prompt_text == history + rendered  # the template's rendering of the request


def test_a_turn_cut_before_its_end_of_turn_gets_the_templates_close_carried() -> None:
    rollout = Rollout(chatml_tokenizer())
    messages = [_user("hi")]
    messages += [rollout.call(messages, "cut short"), _user("go on")]
    child = rollout.plan(messages)
    _on_parent(rollout, child, 1)
    assert child.formation == "extend"
    assert rollout.carried(child) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_every_call_of_a_kept_history_is_the_child_of_the_call_before(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for turn in range(4):
        messages.append(_user(f"question {turn}"))
        messages.append(rollout.call(messages, f"answer {turn}<|im_end|>"))
    assert rollout.plans[0].break_cause is None  # a first call is a root without a cause
    for n, plan in enumerate(rollout.plans[1:], start=1):
        _on_parent(rollout, plan, n)


# ---- which call is the parent -----------------------------------------------------------------


def test_the_deepest_assistant_message_naming_a_call_is_the_parent(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer)
    first = [_user("a")]
    first.append(rollout.call(first, "one<|im_end|>"))
    second = [*first, _user("b")]
    second.append(rollout.call(second, "two<|im_end|>"))
    _on_parent(rollout, rollout.plan([*second, _user("c")]), 2)
    _on_parent(rollout, rollout.plan([*first, _user("other")]), 1)  # a fork of the first


def test_the_latest_of_two_calls_that_returned_the_same_conversation_is_the_parent(
    tokenizer: Any,
) -> None:
    rollout = Rollout(tokenizer)
    messages = [_user("a")]
    rollout.call(messages, "same<|im_end|>")
    again = rollout.call(messages, "same<|im_end|>")  # a retry answered alike
    _on_parent(rollout, rollout.plan([*messages, again, _user("b")]), 2)


def test_an_assistant_message_no_call_returned_is_carried_as_text_after_the_parent(
    tokenizer: Any,
) -> None:
    rollout = Rollout(tokenizer)
    messages = [_user("a")]
    messages.append(rollout.call(messages, "real<|im_end|>"))
    messages += [_user("b"), {"role": "assistant", "content": "written by the harness"}]
    child = rollout.plan([*messages, _user("c")])
    _on_parent(rollout, child, 1)
    assert "written by the harness" in rollout.carried(child)


def test_a_history_no_call_returned_is_a_root_saying_no_parent_match(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer)
    rollout.call([_user("a")], "real<|im_end|>")
    invented = [_user("a"), {"role": "assistant", "content": "invented"}, _user("b")]
    _root(rollout.plan(invented), "no_parent_match", rollout)
    _root(Rollout(tokenizer).plan(invented), None, rollout)  # no call before: no cause


# ---- splices: the parent's exact ids kept where the template re-renders its turn --------------


def test_special_tokens_the_returned_content_lacks_are_a_splice_after_the_templates_close(
    tokenizer: Any,
) -> None:
    rollout = Rollout(tokenizer)
    messages = rollout.answered("x<|im_start|>y<|im_end|>")
    child = rollout.plan(messages)
    _on_parent(rollout, child, 1)
    assert (child.formation, child.splice_cause) == ("splice", "special_tokens")
    # the model's <|im_end|> is kept; the template's "\n" after it is carried
    assert rollout.carried(child) == "\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n"


def test_the_splice_rules_default_when_none_are_given(tokenizer: Any) -> None:
    """`plan_chat` without rules splices as `SpliceRules()` says: no special texts known."""
    rollout = Rollout(tokenizer, LLAMA3_TOOLS_TEMPLATE)
    messages = rollout.answered("  padded  ")

    def render(msgs: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        text: str = tokenizer.apply_chat_template(
            [dict(m) for m in msgs],
            chat_template=LLAMA3_TOOLS_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return text

    priors, gen_starts = rollout.index.snapshot()
    plan = plan_chat(
        [normalize_message(m) for m in messages],
        priors=priors,
        gen_starts=gen_starts,
        render=render,
        encode=rollout.encode,
        add_generation_prompt=True,
    )
    _on_parent(rollout, plan, 1)
    assert (plan.formation, plan.splice_cause) == ("splice", "whitespace")


# ---- breaks, by cause -----------------------------------------------------------------------


def test_a_template_that_rewrites_the_turn_past_recognition_is_a_template_mismatch(
    tokenizer: Any,
) -> None:
    """No end-of-turn text can be found after the turn's content (it is upper-cased)."""
    rollout = Rollout(tokenizer, UPPER_TEMPLATE)
    messages = rollout.answered("quiet<|im_end|>")
    _root(rollout.plan(messages), "template_mismatch", rollout)


def test_a_turn_closed_otherwise_than_a_plain_turn_is_a_template_mismatch(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer, TOOL_TURN_TEMPLATE, tools=TOOLS)
    messages = [_user("a")]
    messages.append(
        rollout.call(messages, 'calc {"a":1}<|im_end|>', content=None, tool_calls=[CALL])
    )
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "1"})
    _root(rollout.plan(messages), "template_mismatch", rollout)


def test_a_template_that_re_renders_history_when_messages_are_added_is_template_unstable(
    tokenizer: Any,
) -> None:
    rollout = Rollout(tokenizer, LAST_USER_SYSTEM_TEMPLATE)
    messages = rollout.answered("b<|im_end|>", then="c")
    _root(rollout.plan(messages), "template_unstable", rollout)


def test_a_history_the_template_now_renders_otherwise_is_history_rewritten(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer, CHATML_TOOLS_TEMPLATE, tools=TOOLS)
    messages = rollout.answered("b<|im_end|>", then="c")
    rollout.tools = [*TOOLS, {"type": "function", "function": {"name": "sub", "parameters": {}}}]
    _root(rollout.plan(messages), "history_rewritten", rollout)


def test_a_render_mismatch_breaks_when_the_gate_is_told_to(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer, config=GateConfig(on_render_mismatch="break"))
    messages = rollout.answered("x<|im_start|>y<|im_end|>")
    _root(rollout.plan(messages), "template_mismatch", rollout)


# ---- reasoning the template drops from history ------------------------------------------------


def _reasoning(
    tokenizer: Any, template: str, **config: Any
) -> tuple[Rollout, list[dict[str, Any]]]:
    """A first call that reasoned, then the user's next turn (the request not planned yet)."""
    rollout = Rollout(tokenizer, TOOLS_HEADER + template, config=GateConfig(**config), tools=TOOLS)
    opened = "" if template == STRIP_REASONING_TEMPLATE else "<think>\n"
    messages = [_user("2 + 2?")]
    messages.append(rollout.call(messages, f"{opened}add them\n</think>\n\nfour<|im_end|>"))
    return rollout, [*messages, _user("sure?")]


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, STRIP_REASONING_TEMPLATE])
def test_stripped_reasoning_breaks_by_default_and_splices_when_keeping_the_models_tokens(
    tokenizer: Any, template: str
) -> None:
    rollout, messages = _reasoning(tokenizer, template)
    _root(rollout.plan(messages), "reasoning_stripped", rollout)
    rollout, messages = _reasoning(tokenizer, template, reasoning="keep_model_tokens")
    child = rollout.plan(messages)
    _on_parent(rollout, child, 1)
    assert (child.formation, child.splice_cause) == ("splice", "reasoning")
    assert "add them" in rollout.decode(child.prompt_ids)


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, STRIP_REASONING_TEMPLATE])
def test_keeping_the_models_reasoning_still_breaks_when_the_gate_breaks_on_mismatch(
    tokenizer: Any, template: str
) -> None:
    rollout, messages = _reasoning(
        tokenizer, template, reasoning="keep_model_tokens", on_render_mismatch="break"
    )
    _root(rollout.plan(messages), "reasoning_stripped", rollout)


@pytest.mark.parametrize(
    ("template", "cause"),
    [(QWEN3_TEMPLATE, "history_rewritten"), (STRIP_REASONING_TEMPLATE, "reasoning_stripped")],
)
def test_keeping_the_models_reasoning_breaks_when_the_history_before_it_changed(
    tokenizer: Any, template: str, cause: str
) -> None:
    """The harness dropped its tools: the parent's prompt is no longer how the history
    renders, whether the template keeps the parent's reasoning (Qwen3 keeps the last
    turn's) or drops it everywhere."""
    rollout, messages = _reasoning(tokenizer, template, reasoning="keep_model_tokens")
    rollout.tools = None
    _root(rollout.plan(messages), cause, rollout)


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, STRIP_REASONING_TEMPLATE])
def test_keeping_the_models_reasoning_needs_the_request_to_end_as_the_probe_does(
    tokenizer: Any, template: str
) -> None:
    """The new messages are read off a probe rendered with the generation prompt: a request
    without it cannot be read so, and is a new root."""
    rollout, messages = _reasoning(tokenizer, template, reasoning="keep_model_tokens")
    plan = rollout.plan(messages, add_generation_prompt=False)
    _root(plan, "reasoning_stripped", rollout)


# ---- why a splice: the causes in their order ------------------------------------------------


@pytest.mark.parametrize(
    ("generated", "rendered", "tools", "cause"),
    [
        ("<think>a</think>b", "b", False, "reasoning"),
        ("a<|im_start|>b", "ab", False, "special_tokens"),
        ("a\ufffdb", "ab", False, "invalid_utf8"),
        ('{"a":1}', '{"a": 1}', True, "tool_call_format"),
        (" a b ", "a b", False, "whitespace"),
        ("abc", "xyz", False, "other"),
        ("a<|im_start|>b\ufffd", "ab", False, "invalid_utf8"),  # not only the special token differs
        ("a<|im_start|> b", "a b ", False, "whitespace"),
        ("a<|im_start|>b", "ac", False, "other"),
        ("ab", "ab ", False, "whitespace"),
    ],
)
def test_a_splice_is_named_by_the_first_difference_that_explains_it(
    generated: str, rendered: str, tools: bool, cause: str
) -> None:
    named = splice_cause(
        generated,
        rendered,
        markers=("<think>",),
        special_texts=("<|im_start|>", "<|im_end|>"),
        tool_calls=tools,
    )
    assert named == cause


def test_the_planned_messages_are_the_normalised_request(tokenizer: Any) -> None:
    rollout = Rollout(tokenizer)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = rollout.request([{"role": "user", "content": parts}])
    assert request.messages == [normalize_message({"role": "user", "content": parts})]
    assert request.decode(rollout.encode("x<|im_end|>")) == "x<|im_end|>"


# ---- the id-level planner (a tokenizer that renders requests to ids) ---------------------------


@pytest.fixture(scope="module")
def mistral() -> Any:
    return mistral_tokenizer("spm")


def _turn(mistral: Any, messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[int]:
    """The assistant turn as ``mistral_common`` encodes it after ``messages`` (``</s>``-closed)."""
    codec = Rollout(mistral, None).renderer.codec  # type: ignore[attr-defined]
    before = codec.request(messages, None)
    return list(codec.history([*messages, reply], None)[len(before) :])


def test_an_id_level_child_is_its_parents_exact_ids_then_the_new_messages_ids(
    mistral: Any,
) -> None:
    rollout = Rollout(mistral, None)
    messages = [_user("hi")]
    answer = {"role": "assistant", "content": "hello there"}
    messages += [rollout.call(messages, _turn(mistral, messages, answer)), _user("bye")]
    child = rollout.plan(messages)
    _on_parent(rollout, child, 1)
    assert (child.formation, child.splice_cause) == ("extend", None)
    assert child.prompt_ids == mistral.apply_chat_template(messages)


def test_an_id_level_turn_cut_before_its_end_of_turn_gets_it_carried(mistral: Any) -> None:
    rollout = Rollout(mistral, None)
    messages = [_user("hi")]
    answer = {"role": "assistant", "content": "hello there"}
    cut = _turn(mistral, messages, answer)[:-1]
    messages += [rollout.call(messages, cut), _user("bye")]
    child = rollout.plan(messages)
    _on_parent(rollout, child, 1)
    assert child.prompt_ids[child.prefix_len] == mistral.eos_token_id
    assert child.prompt_ids == mistral.apply_chat_template(messages)


def test_an_id_level_history_no_call_returned_is_a_root(mistral: Any) -> None:
    rollout = Rollout(mistral, None)
    rollout.call(
        [_user("hi")], _turn(mistral, [_user("hi")], {"role": "assistant", "content": "x"})
    )
    invented = [_user("hi"), {"role": "assistant", "content": "invented"}, _user("bye")]
    plan = rollout.plan(invented)
    assert (plan.parent_id, plan.break_cause) == (None, "no_parent_match")
    assert plan.prompt_ids == mistral.apply_chat_template(invented)


def test_an_id_level_prior_that_does_not_say_what_it_generated_is_never_a_parent(
    mistral: Any,
) -> None:
    """`plan_chat_ids` reads a parent's generated ids off its ``gen_len``: a prior without
    it (``gen_len=0``) cannot be split, so it is no parent."""
    rollout = Rollout(mistral, None)
    messages = [_user("hi")]
    answer = {"role": "assistant", "content": "hello"}
    messages += [rollout.call(messages, _turn(mistral, messages, answer)), _user("bye")]
    rollout.index.snapshot()[0][0].gen_len = 0
    plan = rollout.plan(messages)
    assert (plan.parent_id, plan.break_cause) == (None, "no_parent_match")


def _spelled(mistral: Any, text: str) -> list[int]:
    """``text`` one SentencePiece piece per character (decodes to ``text``, not its ids)."""
    return [mistral.convert_tokens_to_ids(ch) for ch in "▁" + text.replace(" ", "▁")]


@pytest.mark.parametrize(
    ("style", "cause"),
    [
        ("stray_control", "special_tokens"),
        ("partial_character", "invalid_utf8"),
        ("trailing_space", "whitespace"),
        ("spelled", "other"),
    ],
)
def test_an_id_level_turn_the_tokenizer_encodes_otherwise_is_a_splice_by_cause(
    mistral: Any, style: str, cause: str
) -> None:
    """The model's ids are kept; the cause says how they differ from the tokenizer's turn."""
    rollout, eos = Rollout(mistral, None), mistral.eos_token_id
    words = list(mistral.encode("hello there", add_special_tokens=False))
    generated, content = {
        "stray_control": ([*words, mistral.convert_tokens_to_ids("[INST]"), eos], None),
        "partial_character": (
            [*words, *mistral.convert_tokens_to_ids(["<0xF0>", "<0x9F>"]), eos],
            "hello there",
        ),
        "trailing_space": ([*mistral.encode("hello there ", add_special_tokens=False), eos], None),
        "spelled": ([*_spelled(mistral, "hello there"), eos], None),
    }[style]
    messages = [_user("hi")]
    reply = rollout.call(messages, generated, **({} if content is None else {"content": content}))
    child = rollout.plan([*messages, reply, _user("bye")])
    _on_parent(rollout, child, 1)
    assert (child.formation, child.splice_cause) == ("splice", cause)
    assert (
        child.prompt_ids[child.prefix_len :]
        == mistral.apply_chat_template([*messages, reply, _user("bye")])[
            -len(child.prompt_ids) + child.prefix_len :
        ]
    )


def test_an_id_level_new_user_turn_after_a_system_prompt_is_template_unstable(
    mistral: Any,
) -> None:
    """Mistral's v3 tokenizers write the system prompt before the *last* user message."""
    rollout = Rollout(mistral, None)
    messages = [{"role": "system", "content": "be brief"}, _user("hi")]
    answer = {"role": "assistant", "content": "hello"}
    messages += [rollout.call(messages, _turn(mistral, messages, answer)), _user("bye")]
    plan = rollout.plan(messages)
    assert (plan.parent_id, plan.break_cause) == (None, "template_unstable")
    assert plan.prompt_ids == mistral.apply_chat_template(messages)
