"""Parent resolution and splicing without an engine: the tiny tokenizer, real chat templates.

A `Harness` plays what the gate and vLLM do around the planner: it plans each call with
`plan_chat`, "generates" token ids drawn by hypothesis (random ids, as the tiny random
model samples: special tokens and partial UTF-8 bytes included), returns the content vLLM
would return (special tokens skipped), and records the call as a prior the way the gate
does (its template-rendered prompt, its generation decoded with special tokens, its exact
cumulative ids). The laws: a harness that keeps its history keeps every call on one chain,
each child's prompt starts with its parent's exact ids, and what is carried after them is
exactly what the template renders after the parent's turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm._helpers import STRIP_REASONING_TEMPLATE
from tests.vllm._templates import (
    CHATML_TOOLS_TEMPLATE,
    FAMILIES,
    LLAMA3_TOOLS_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_TEMPLATE,
)
from tokcap.tiny import CHATML_TEMPLATE
from tokcap_core import ConfigError
from tokcap_core.ledger import BREAK_CAUSES, SPLICE_CAUSES
from tokcap_vllm import GateConfig
from tokcap_vllm.fingerprints import message_fingerprints, normalize_message
from tokcap_vllm.gate._planning._plan_text import ChatPlan, PriorCall, plan_chat
from tokcap_vllm.gate._planning._splice import SpliceRules

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate a op b.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


class Harness:
    """One rollout: plans calls like the gate, answers like vLLM, keeps the transcript."""

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        *,
        rules: SpliceRules | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.template = template
        self.tools = tools
        self.rules = rules or SpliceRules(special_texts=tuple(tokenizer.all_special_tokens))
        self.priors: list[PriorCall] = []
        self.gen_starts: dict[str, int] = {}
        self.plans: list[ChatPlan] = []
        self.eos = tokenizer.eos_token_id

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        text: str = self.tok.apply_chat_template(
            [dict(m) for m in messages],
            tools=self.tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def call(
        self, messages: list[dict[str, Any]], output_ids: list[int], **assistant: Any
    ) -> dict[str, Any]:
        """Plan a call, "generate" ``output_ids``, return the assistant message vLLM returns.

        ``assistant`` overrides the returned message's fields (tool calls a parser found).
        """
        normalized = [normalize_message(m) for m in messages]
        plan = plan_chat(
            normalized,
            priors=self.priors,
            gen_starts=self.gen_starts,
            render=self.render,
            encode=self.encode,
            add_generation_prompt=True,
            rules=self.rules,
        )
        self.plans.append(plan)
        returned = {"role": "assistant", "content": self.content(output_ids), **assistant}
        call_id = f"c{len(self.plans):06d}"
        generated = self.tok.decode(output_ids, skip_special_tokens=False)
        fp = message_fingerprints([*normalized, normalize_message(returned)])[-1]
        self.priors.append(
            PriorCall(
                call_id, "chat", plan.prompt_text + generated, plan.prompt_ids + output_ids, fp
            )
        )
        self.gen_starts[call_id] = len(plan.prompt_text)
        return returned

    def greeted(self, answer: str) -> list[dict[str, Any]]:
        """A first call: the user says ``hi``, the model answers ``answer`` closed by eos.
        The conversation after it (the user's turn, the message vLLM returned)."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        return [*messages, self.call(messages, [*self.encode(answer), self.eos])]

    def follow_up(self, messages: list[dict[str, Any]], user: str) -> tuple[ChatPlan, list[int]]:
        """The user says ``user`` after ``messages`` and the model ends at once: that call's
        plan and the ids of the call before it."""
        self.call([*messages, {"role": "user", "content": user}], [self.eos])
        return self.plans[-1], self.cum_ids(len(self.plans) - 2)

    def content(self, output_ids: list[int]) -> str:
        """What vLLM returns as content: the text with special tokens skipped."""
        text: str = self.tok.decode(output_ids, skip_special_tokens=True)
        return text

    def cum_ids(self, index: int) -> list[int]:
        return list(self.priors[index].cum_ids)


def generations(vocab: int, eos: int) -> st.SearchStrategy[list[int]]:
    """Token ids a random model samples: any id, ending on eos or cut by max_tokens."""
    body = st.lists(st.integers(0, vocab - 1).filter(lambda t: t != eos), min_size=1, max_size=10)
    return st.tuples(body, st.booleans()).map(lambda p: p[0] + [eos] if p[1] else p[0])


def _no_chain_break(harness: Harness) -> None:
    """Every call after the first extends the call before it, on its exact ids."""
    for i, plan in enumerate(harness.plans[1:], start=1):
        parent = harness.cum_ids(i - 1)
        assert plan.parent_id == f"c{i:06d}", (plan.formation, plan.break_cause)
        assert plan.formation in ("extend", "splice")
        assert plan.prefix_len == len(parent)
        assert plan.prompt_ids[: len(parent)] == parent
        assert (plan.formation == "splice") == (plan.splice_cause is not None)
        assert plan.splice_cause is None or plan.splice_cause in SPLICE_CAUSES


# ---- laws over random generations ----------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), turns=st.integers(2, 4))
def test_a_harness_that_keeps_its_history_stays_on_one_chain(
    tokenizer: Any, data: st.DataObject, turns: int
) -> None:
    harness = Harness(tokenizer, CHATML_TEMPLATE)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    for turn in range(turns):
        out = data.draw(generations(len(tokenizer), harness.eos))
        messages.append(harness.call(messages, out))
        messages.append({"role": "user", "content": f"turn {turn}: go on"})
    _no_chain_break(harness)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_what_is_carried_is_the_templates_text_after_the_parents_turn(
    tokenizer: Any, data: st.DataObject
) -> None:
    """The child's ids: the parent's exact ids, ``<|im_end|>`` only if it never ended
    its turn, then exactly the template's text for the new user turn."""
    harness = Harness(tokenizer, CHATML_TEMPLATE)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    out = data.draw(generations(len(tokenizer), harness.eos))
    messages += [harness.call(messages, out), {"role": "user", "content": "and then?"}]
    harness.call(messages, [harness.eos])
    child, parent = harness.plans[1], harness.cum_ids(0)
    carried = tokenizer.decode(child.prompt_ids[len(parent) :], skip_special_tokens=False)
    close = "\n" if out[-1] == harness.eos else "<|im_end|>\n"
    assert carried == close + "<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    clean = tokenizer.decode(out, skip_special_tokens=False).removesuffix("<|im_end|>")
    assert (child.formation == "extend") == (clean == harness.content(out)), clean


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), family=st.sampled_from(sorted(FAMILIES)))
def test_every_family_keeps_a_plain_conversation_on_one_chain(
    tokenizer: Any, data: st.DataObject, family: str
) -> None:
    harness = Harness(tokenizer, FAMILIES[family])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "1 + 1?"},
    ]
    for turn in range(3):
        out = data.draw(generations(len(tokenizer), harness.eos))
        messages.append(harness.call(messages, out))
        messages.append({"role": "user", "content": f"again ({turn})"})
    _no_chain_break(harness)


# ---- splice causes -------------------------------------------------------------------------


def test_special_tokens_the_content_omits_are_a_splice(tokenizer: Any) -> None:
    harness = Harness(tokenizer, CHATML_TEMPLATE)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    out = [*harness.encode("hello"), start, *harness.encode(" world"), harness.eos]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages += [harness.call(messages, out), {"role": "user", "content": "more"}]
    harness.call(messages, [harness.eos])
    assert harness.plans[1].formation == "splice"
    assert harness.plans[1].splice_cause == "special_tokens"
    _no_chain_break(harness)


def test_bytes_that_decode_to_u_fffd_are_a_splice(tokenizer: Any) -> None:
    """A lone byte of a multi-byte character decodes to U+FFFD; vLLM's detokenizer holds
    such bytes back, so the content the harness echoes lacks it."""
    harness = Harness(tokenizer, CHATML_TEMPLATE)
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    out = [*harness.encode("ab"), lone, *harness.encode("cd"), harness.eos]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages.append(harness.call(messages, out, content="abcd"))
    messages.append({"role": "user", "content": "more"})
    harness.call(messages, [harness.eos])
    assert (harness.plans[1].formation, harness.plans[1].splice_cause) == ("splice", "invalid_utf8")
    _no_chain_break(harness)


def test_a_parsers_reserialised_tool_call_is_a_splice(tokenizer: Any) -> None:
    harness = Harness(tokenizer, CHATML_TOOLS_TEMPLATE, tools=TOOLS)
    text = '<tool_call>\n{"name": "calc", "arguments": {"a":1,\n"b":2}}\n</tool_call>'
    out = [*harness.encode(text), harness.eos]
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "calc", "arguments": '{"a": 1, "b": 2}'},
        }
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "1 + 2?"}]
    messages.append(harness.call(messages, out, content=None, tool_calls=calls))
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "3"})
    harness.call(messages, [harness.eos])
    child, parent = harness.plans[1], harness.cum_ids(0)
    assert (child.formation, child.splice_cause) == ("splice", "tool_call_format")
    carried = tokenizer.decode(child.prompt_ids[len(parent) :], skip_special_tokens=False)
    assert carried == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_a_tool_call_written_as_the_template_writes_it_is_an_extend(tokenizer: Any) -> None:
    harness = Harness(tokenizer, CHATML_TOOLS_TEMPLATE, tools=TOOLS)
    text = '<tool_call>\n{"name": "calc", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    calls = [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"a":1,"b":2}'}}
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "1 + 2?"}]
    out = [*harness.encode(text), harness.eos]
    messages.append(harness.call(messages, out, content=None, tool_calls=calls))
    messages += [{"role": "tool", "tool_call_id": "c", "content": "3"}]
    harness.call(messages, [harness.eos])
    assert harness.plans[1].formation == "extend"


def test_whitespace_the_template_trims_is_a_splice(tokenizer: Any) -> None:
    harness = Harness(tokenizer, LLAMA3_TOOLS_TEMPLATE)
    child, parent = harness.follow_up(harness.greeted("  padded  "), "ok")
    assert (child.formation, child.splice_cause) == ("splice", "whitespace")
    carried = tokenizer.decode(child.prompt_ids[len(parent) :])
    assert carried.startswith("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nok")


def test_a_model_that_writes_the_templates_close_itself_gets_no_second_one(
    tokenizer: Any,
) -> None:
    harness = Harness(tokenizer, LLAMA3_TOOLS_TEMPLATE)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    out = harness.encode(" x <|eot_id|>")  # plain text for this tokenizer
    messages.append(harness.call(messages, out, content=" x "))
    child, parent = harness.follow_up(messages, "ok")
    assert (child.formation, child.splice_cause) == ("splice", "whitespace")
    assert tokenizer.decode(child.prompt_ids[len(parent) :]).startswith("<|start_header_id|>user")


def test_parallel_tool_calls_and_their_results_stay_on_the_chain(tokenizer: Any) -> None:
    harness = Harness(tokenizer, CHATML_TOOLS_TEMPLATE, tools=TOOLS)
    one = '<tool_call>\n{"name": "calc", "arguments": {"a":1,"b":2}}\n</tool_call>'
    two = '<tool_call>\n{"name": "calc", "arguments": {"a":3,"b":4}}\n</tool_call>'
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "calc", "arguments": args}}
        for i, args in enumerate(('{"a": 1, "b": 2}', '{"a": 3, "b": 4}'))
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "two sums"}]
    out = [*harness.encode(one + "\n" + two), harness.eos]
    messages.append(harness.call(messages, out, content=None, tool_calls=calls))
    messages += [
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]
    messages.append(harness.call(messages, [*harness.encode("10"), harness.eos]))
    messages.append({"role": "user", "content": "thanks"})
    harness.call(messages, [harness.eos])
    _no_chain_break(harness)
    assert [p.formation for p in harness.plans] == ["root", "splice", "extend"]


# ---- breaks that stay breaks ---------------------------------------------------------------


def test_history_the_template_now_renders_differently_is_a_break(tokenizer: Any) -> None:
    """Messages unchanged (the fingerprints match) but the tool list changed: the parent's
    prompt is no longer how the template renders that history."""
    harness = Harness(tokenizer, CHATML_TOOLS_TEMPLATE, tools=TOOLS)
    messages = harness.greeted("yo")
    harness.tools = [*TOOLS, {**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "sub"}}]
    plan, _ = harness.follow_up(messages, "bye")
    assert (plan.formation, plan.break_cause) == ("root", "history_rewritten")


def test_a_summarised_history_finds_no_parent(tokenizer: Any) -> None:
    harness = Harness(tokenizer, CHATML_TEMPLATE)
    harness.greeted("yo")
    harness.call([{"role": "user", "content": "(summary) hi, yo; go on"}], [harness.eos])
    assert (harness.plans[1].formation, harness.plans[1].break_cause) == ("root", "no_parent_match")


def test_on_render_mismatch_break_restores_the_break(tokenizer: Any) -> None:
    rules = SpliceRules(
        special_texts=tuple(tokenizer.all_special_tokens), on_render_mismatch="break"
    )
    harness = Harness(tokenizer, CHATML_TEMPLATE, rules=rules)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages += [harness.call(messages, [start, *harness.encode("x"), harness.eos])]
    plan, _ = harness.follow_up(messages, "more")
    assert (plan.formation, plan.break_cause) == ("root", "template_mismatch")
    assert plan.prompt_ids == harness.encode(plan.prompt_text)


# ---- reasoning -----------------------------------------------------------------------------


def _reasoning_rollout(tokenizer: Any, template: str, reasoning: str) -> Harness:
    """Three turns whose generations reason first (the R1-style template opens the block)."""
    rules = SpliceRules(
        special_texts=tuple(tokenizer.all_special_tokens),
        reasoning=reasoning,  # type: ignore[arg-type]
    )
    harness = Harness(tokenizer, template, rules=rules)
    opened = "" if template == STRIP_REASONING_TEMPLATE else "<think>\n"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2 + 2?"}]
    for turn in range(3):
        out = [*harness.encode(f"{opened}add them {turn}\n</think>\n\nfour"), harness.eos]
        messages += [harness.call(messages, out), {"role": "user", "content": f"sure? {turn}"}]
    return harness


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, STRIP_REASONING_TEMPLATE])
def test_reasoning_the_template_strips_breaks_when_following_the_template(
    tokenizer: Any, template: str
) -> None:
    harness = _reasoning_rollout(tokenizer, template, "follow_template")
    assert [p.break_cause for p in harness.plans] == [
        None,
        "reasoning_stripped",
        "reasoning_stripped",
    ]
    for plan in harness.plans:
        assert plan.prompt_ids == harness.encode(plan.prompt_text)  # what the template serves


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, STRIP_REASONING_TEMPLATE])
def test_keep_model_tokens_splices_past_stripped_reasoning(tokenizer: Any, template: str) -> None:
    harness = _reasoning_rollout(tokenizer, template, "keep_model_tokens")
    _no_chain_break(harness)
    assert [p.splice_cause for p in harness.plans[1:]] == ["reasoning", "reasoning"]
    child, parent = harness.plans[2], harness.cum_ids(1)
    carried = tokenizer.decode(child.prompt_ids[len(parent) :], skip_special_tokens=False)
    prompt = "<|im_start|>assistant\n" + (
        "<think>\n" if template == STRIP_REASONING_TEMPLATE else ""
    )
    assert carried == "\n<|im_start|>user\nsure? 1<|im_end|>\n" + prompt
    assert "add them 0" in tokenizer.decode(child.prompt_ids)  # the model's reasoning kept


# ---- pure pieces ---------------------------------------------------------------------------


def test_break_and_splice_causes_come_from_the_ledgers_closed_sets() -> None:
    assert {"history_rewritten", "reasoning_stripped", "template_mismatch"} <= set(BREAK_CAUSES)
    assert "template_unstable" in BREAK_CAUSES
    assert set(SPLICE_CAUSES) == {
        "special_tokens",
        "invalid_utf8",
        "tool_call_format",
        "whitespace",
        "reasoning",
        "other",
    }


def test_the_mistral_text_template_closes_turns_with_eos(tokenizer: Any) -> None:
    harness = Harness(tokenizer, MISTRAL_TEMPLATE)
    child, parent = harness.follow_up(harness.greeted(" yo"), "bye")
    assert child.formation == "extend"
    assert tokenizer.decode(child.prompt_ids[len(parent) :]) == "[INST] bye [/INST]"


@pytest.mark.parametrize(("field", "bad"), [("on_render_mismatch", "drop"), ("reasoning", "both")])
def test_the_gate_config_validates_its_splice_choices(field: str, bad: str) -> None:
    config = GateConfig()
    assert (config.on_render_mismatch, config.reasoning) == ("splice", "follow_template")
    with pytest.raises(ConfigError) as info:
        GateConfig(**{field: bad})
    assert info.value.code == f"bad_{field}"
