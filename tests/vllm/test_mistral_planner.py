"""The id-level planner with the real Mistral tokenizers, no engine: laws over rollouts.

A rollout is simulated the way the gate sees it: each call is planned from the rollout's
earlier calls (`PriorCall` with the exact cumulative ids and how many were generated), the
"model" generates a turn in a given style (exactly as ``mistral_common`` encodes it, cut by
the length limit, spelled in other tokens, with a trailing space, with a stray control
token, or as a ``[TOOL_CALLS]`` array without the ids Mistral's history carries), and the
harness echoes the returned message, as vLLM returns it, and answers. The tokenizers are
the two ``mistral_common`` ships (Tekken and SentencePiece v3) behind vLLM's own
``MistralTokenizer``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokcap.tiny import MISTRAL_TOKENIZERS
from tokcap_vllm import GateConfig
from tokcap_vllm.errors import Unsupported, UnsupportedTokenizer
from tokcap_vllm.fingerprints import message_fingerprints, normalize_message
from tokcap_vllm.gate._planning import ChatPlan, PriorCall, request_renderer
from tokcap_vllm.gate._planning._plan_ids import plan_chat_ids, splice_cause
from tokcap_vllm.gate._planning._render_ids import IdRequestRenderer, MistralCodec, probe_follow_up
from tokcap_vllm.gate._wire import decode_body

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
            },
        },
    }
]
STYLES = ("exact", "cut", "spelled", "trailing_space", "stray_control")


def _vllm_tokenizer(kind: str, folder: Path) -> Any:
    import mistral_common
    from vllm.tokenizers.mistral import MistralTokenizer

    source, target = MISTRAL_TOKENIZERS[kind]
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(mistral_common.__file__).parent / "data" / source, folder / target)
    return MistralTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module", params=sorted(MISTRAL_TOKENIZERS))
def codec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MistralCodec:
    return MistralCodec(_vllm_tokenizer(request.param, tmp_path_factory.mktemp(request.param)))


@dataclass
class Rollout:
    """The gate's view of one rollout: its earlier calls, planned by `plan_chat_ids`."""

    codec: MistralCodec
    tools: list[dict[str, Any]] | None
    splice: bool = True
    priors: list[PriorCall] = field(default_factory=list)

    def plan(self, messages: list[dict[str, Any]]) -> ChatPlan:
        codec, tools = self.codec, self.tools
        return plan_chat_ids(
            [normalize_message(m) for m in messages],
            priors=self.priors,
            request=lambda n: codec.request(messages[:n], tools),
            history=lambda n: codec.history(messages[:n], tools),
            end_of_turn=codec.end_of_turn,
            special_ids=codec.special_ids,
            decode=codec.decode,
            splice=self.splice,
        )

    def served(
        self, messages: list[dict[str, Any]], plan: ChatPlan, gen: list[int], reply: dict[str, Any]
    ) -> None:
        """The call returned ``reply`` (generated ids ``gen``): it may now be a parent."""
        fp = message_fingerprints([normalize_message(m) for m in [*messages, reply]])[-1]
        cum = plan.prompt_ids + gen
        call_id = f"c{len(self.priors) + 1:06d}"
        self.priors.append(PriorCall(call_id, "chat", "", cum, fp, gen_len=len(gen)))

    def first_exchange(
        self, user: str, answer: str
    ) -> tuple[list[dict[str, Any]], ChatPlan, dict[str, Any]]:
        """A root call (``user`` asks) served with ``answer`` as its exact turn: the request's
        messages, its plan and the reply."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
        plan = self.plan(messages)
        reply = {"role": "assistant", "content": answer}
        self.served(messages, plan, self.turn_ids(messages, reply), reply)
        return messages, plan, reply

    def turn_ids(self, messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[int]:
        """The assistant turn as ``mistral_common`` encodes it after ``messages`` (eos-closed)."""
        before = self.codec.request(messages, self.tools)
        return self.codec.history([*messages, reply], self.tools)[len(before) :]


def _encode(codec: MistralCodec, text: str) -> list[int]:
    return list(codec.tokenizer.encode(text, add_special_tokens=False))


def _spelled(codec: MistralCodec, text: str) -> list[int]:
    """``text`` one character per token (decodes to ``text``; rarely the canonical ids).

    SentencePiece writes a space as ``▁`` and starts the text with one; a character with
    no piece of its own falls back to its UTF-8 bytes (``<0xF0>``, ...).
    """
    tok = codec.tokenizer
    if tok.is_tekken:
        return [t for ch in text for t in _encode(codec, ch)]
    ids = []
    for ch in "▁" + text.replace(" ", "▁"):
        piece = tok.convert_tokens_to_ids(ch)
        if piece > 0:
            ids.append(piece)
        else:
            ids.extend(tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in ch.encode())
    return ids


def _generate(
    codec: MistralCodec, style: str, turn: list[int], content: str
) -> tuple[list[int], str]:
    """The model's ids for a content turn in ``style``, and the content vLLM returns."""
    eos = codec.end_of_turn
    if style == "exact":
        return turn, content
    if style == "cut":  # finish_reason "length": the turn never got its </s>
        return turn[:-1], content
    if style == "spelled":
        return [*_spelled(codec, content), eos], content
    if style == "trailing_space":  # returned with the space; mistral_common strips it
        return [*_encode(codec, content + " "), eos], content + " "
    inst = codec.tokenizer.convert_tokens_to_ids("[INST]")
    body = turn[:-1]
    return [*body[:1], inst, *body[1:], eos], codec.decode([*body[:1], inst, *body[1:]])


def _tool_turn(
    codec: MistralCodec, call_ids: list[str], args: list[str]
) -> tuple[list[int], dict[str, Any]]:
    """A ``[TOOL_CALLS]`` array as the model emits it (no ids) and the message vLLM returns."""
    calls = [{"name": "lookup", "arguments": {"q": a}} for a in args]
    marker = codec.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    gen = [marker, *_encode(codec, json.dumps(calls)), codec.end_of_turn]
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": i,
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": a})},
            }
            for i, a in zip(call_ids, args, strict=True)
        ],
    }
    return gen, reply


words = st.text(
    alphabet=st.sampled_from(list("abcdefghijklmnopqrstuvwxyz,.!?éß漢🙂")), min_size=1, max_size=12
)
sentences = st.lists(words, min_size=1, max_size=4).map(" ".join)
call_ids = st.text(
    alphabet=st.sampled_from(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789")),
    min_size=9,
    max_size=9,
)
tool_steps = st.lists(
    st.tuples(
        st.lists(call_ids, min_size=1, max_size=2, unique=True),
        st.lists(words, min_size=2, max_size=2),
    ),
    min_size=1,
    max_size=3,
)
LAW = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@LAW
@given(
    user=sentences,
    steps=st.lists(
        st.tuples(sentences, st.sampled_from(STYLES), sentences), min_size=1, max_size=4
    ),
)
def test_plain_chat_extends_or_splices_and_keeps_the_models_ids(
    codec: MistralCodec, user: str, steps: list[tuple[str, str, str]]
) -> None:
    """No tools, no system prompt: every later call has a parent; exactly-encoded turns
    extend and reproduce the tokenizer's own rendering; others splice, by cause."""
    rollout = Rollout(codec, tools=None)
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    plan = rollout.plan(messages)
    assert plan.parent_id is None
    assert plan.break_cause is None
    assert plan.prompt_ids == codec.request(messages, None)
    all_extend = True
    for content, style, next_user in steps:
        reply = {"role": "assistant", "content": content}
        turn = rollout.turn_ids(messages, reply)
        gen, returned = _generate(codec, style, turn, content)
        reply = {"role": "assistant", "content": returned}
        rollout.served(messages, plan, gen, reply)
        parent_cum = rollout.priors[-1].cum_ids
        messages = [*messages, reply, {"role": "user", "content": next_user}]
        plan = rollout.plan(messages)
        close = [] if gen[-1] == codec.end_of_turn else [codec.end_of_turn]
        turn = rollout.turn_ids(messages[:-2], reply)
        assert plan.parent_id == rollout.priors[-1].call_id
        assert plan.prompt_ids[: len(parent_cum)] == list(parent_cum)
        assert plan.prefix_len == len(parent_cum)
        new = codec.request(messages, None)[len(codec.history(messages[:-1], None)) :]
        assert plan.prompt_ids == [*parent_cum, *close, *new]
        if gen + close == turn:
            assert (plan.formation, plan.splice_cause) == ("extend", None)
        else:
            all_extend = False
            expected = {
                "spelled": "other",
                "trailing_space": "whitespace",
                "stray_control": "special_tokens",
            }
            assert plan.formation == "splice"
            assert plan.splice_cause == expected[style]
        if all_extend:  # an unbroken run of exact turns is exactly what vLLM itself renders
            assert plan.prompt_ids == codec.request(messages, None)


@LAW
@given(user=sentences, steps=tool_steps, final=sentences)
def test_tool_loop_is_one_chain_of_tool_call_splices(
    codec: MistralCodec, user: str, steps: list[tuple[list[str], list[str]]], final: str
) -> None:
    """Tools: user, then [TOOL_CALLS] turns answered by tool messages, then a final answer:
    one chain; each tool-call turn is spliced (Mistral's history carries ids the model
    never generates); the tool results are encoded as the tokenizer serves them."""
    rollout = Rollout(codec, tools=TOOLS)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": user},
    ]
    plan = rollout.plan(messages)
    assert plan.prompt_ids == codec.request(messages, TOOLS)
    for ids, args in steps:
        gen, reply = _tool_turn(codec, ids, args[: len(ids)])
        rollout.served(messages, plan, gen, reply)
        parent = rollout.priors[-1]
        results = [
            {"role": "tool", "tool_call_id": i, "content": f"result {n}"} for n, i in enumerate(ids)
        ]
        messages = [*messages, reply, *results]
        plan = rollout.plan(messages)
        assert (plan.parent_id, plan.formation, plan.splice_cause) == (
            parent.call_id,
            "splice",
            "tool_call_format",
        )
        new = codec.request(messages, TOOLS)[len(codec.history(messages[: -len(ids)], TOOLS)) :]
        assert plan.prompt_ids == [*parent.cum_ids, *new]
        assert new.count(codec.tokenizer.convert_tokens_to_ids("[TOOL_RESULTS]")) == len(ids)
    reply = {"role": "assistant", "content": final}
    rollout.served(messages, plan, rollout.turn_ids(messages, reply), reply)
    assert len({p.call_id for p in rollout.priors}) == len(steps) + 1


def test_a_new_user_turn_after_tools_is_a_break(codec: MistralCodec) -> None:
    """Mistral's v3 tokenizers put the tool list and the system prompt before the *last*
    user message: a new user turn re-renders history, so the call is a new root
    (``template_unstable``) rendered exactly as vLLM renders it."""
    rollout = Rollout(codec, tools=TOOLS)
    messages, plan, reply = rollout.first_exchange("look up cat", "done")
    messages = [*messages, reply, {"role": "user", "content": "and dog?"}]
    plan = rollout.plan(messages)
    assert (plan.parent_id, plan.formation, plan.break_cause) == (None, "root", "template_unstable")
    assert plan.prompt_ids == codec.request(messages, TOOLS)


def test_an_edited_history_is_a_new_root(codec: MistralCodec) -> None:
    rollout = Rollout(codec, tools=None)
    messages, _, _ = rollout.first_exchange("hello", "hi there")
    edited = [
        *messages,
        {"role": "assistant", "content": "hi (edited)"},
        {"role": "user", "content": "go on"},
    ]
    plan = rollout.plan(edited)
    assert (plan.parent_id, plan.break_cause) == (None, "no_parent_match")
    assert plan.prompt_ids == codec.request(edited, None)


def test_break_instead_of_splice_when_configured(codec: MistralCodec) -> None:
    """``on_render_mismatch="break"``: a turn the tokenizer encodes differently starts a new
    root (``template_mismatch``); an exactly encoded one still extends."""
    rollout = Rollout(codec, tools=None, splice=False)
    messages, plan, reply = rollout.first_exchange("hello", "hi there")
    follow = [*messages, reply, {"role": "user", "content": "more"}]
    assert rollout.plan(follow).formation == "extend"
    spaced = {"role": "assistant", "content": "hi there "}
    rollout.served(messages, plan, [*_encode(codec, "hi there "), codec.end_of_turn], spaced)
    plan = rollout.plan([*messages, spaced, {"role": "user", "content": "more"}])
    assert (plan.parent_id, plan.break_cause) == (None, "template_mismatch")


def test_a_turn_the_tokenizer_cannot_close_is_a_break(codec: MistralCodec) -> None:
    """When the finished conversation cannot be encoded (``history`` gives None) the call is
    a new root (``template_mismatch``), never a refusal on a later turn."""
    rollout = Rollout(codec, tools=None)
    messages, plan, reply = rollout.first_exchange("hello", "hi")
    follow = [*messages, reply, {"role": "user", "content": "more"}]
    plan = plan_chat_ids(
        [normalize_message(m) for m in follow],
        priors=rollout.priors,
        request=lambda n: codec.request(follow[:n], None),
        history=lambda n: None,
        end_of_turn=codec.end_of_turn,
        special_ids=codec.special_ids,
        decode=codec.decode,
    )
    assert (plan.parent_id, plan.break_cause) == (None, "template_mismatch")
    assert plan.prompt_ids == codec.request(follow, None)


def test_splice_causes(codec: MistralCodec) -> None:
    kw = {"special_ids": codec.special_ids, "decode": codec.decode}
    inst = codec.tokenizer.convert_tokens_to_ids("[INST]")
    text = _encode(codec, "hello world")
    assert splice_cause(text, text[:1], tool_calls=True, **kw) == "tool_call_format"
    assert splice_cause([inst, *text], text, tool_calls=False, **kw) == "special_tokens"
    assert (
        splice_cause(_encode(codec, "hello world "), text, tool_calls=False, **kw) == "whitespace"
    )
    assert splice_cause(_spelled(codec, "hello world"), text, tool_calls=False, **kw) == "other"
    if codec.tokenizer.is_tekken:  # the first of the emoji's byte tokens
        partial = _encode(codec, "🙂")[:1]
    else:  # SentencePiece's byte-fallback pieces for the emoji's first two bytes
        partial = [codec.tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in b"\xf0\x9f"]
    assert "\ufffd" in codec.decode(partial)
    assert splice_cause([*text, *partial], text, tool_calls=False, **kw) == "invalid_utf8"


def test_both_shipped_tokenizers_pass_the_follow_up_probe(codec: MistralCodec) -> None:
    assert probe_follow_up(codec) is None


# ---- choosing and refusing a renderer -----------------------------------------------------


def test_request_renderer_plans_mistral_tokenizers_at_the_token_level(tmp_path: Path) -> None:
    tokenizer = _vllm_tokenizer("tekken", tmp_path)
    renderer = request_renderer(tokenizer, None, GateConfig(), 4096)
    assert isinstance(renderer, IdRequestRenderer)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}).encode()
    messages, plan = renderer.planner(decode_body(body, "chat", token_ids_allowed=True))
    made = plan([], {})
    assert messages == [normalize_message({"role": "user", "content": "hi"})]
    assert made.formation == "root"
    assert made.prompt_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=TOOLS
    )


def test_a_chat_template_is_refused_in_mistral_mode(tmp_path: Path) -> None:
    renderer = request_renderer(_vllm_tokenizer("spm", tmp_path), None, GateConfig(), 4096)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"})
    with pytest.raises(Unsupported) as e:
        renderer.planner(decode_body(body.encode(), "chat", token_ids_allowed=True))
    assert e.value.code == "chat_template_unsupported"


def test_a_tokenizer_that_cannot_plan_follow_ups_is_refused_naming_it(tmp_path: Path) -> None:
    """A fault the shipped tokenizers do not have, made on the real one (a fake, said so):
    served requests end with a generation marker the finished turn does not keep, as a
    ChatML-style assistant header would. The renderer is refused with a typed error."""
    real = _vllm_tokenizer("tekken", tmp_path)

    class MarkedTokenizer(type(real)):  # type: ignore[misc]
        def apply_chat_template(self, messages: Any, tools: Any = None, **kwargs: Any) -> list[int]:
            return [*super().apply_chat_template(messages, tools, **kwargs), self.bos_token_id]

    marked = MarkedTokenizer(real.transformers_tokenizer)
    with pytest.raises(UnsupportedTokenizer) as e:
        request_renderer(marked, None, GateConfig(), 4096)
    assert e.value.code == "tokenizer_unsupported"
    assert "MarkedTokenizer (Tekkenizer v3)" in e.value.message
    assert type(e.value).status == 400


def test_the_renderer_splices_unless_the_gate_is_configured_to_break(tmp_path: Path) -> None:
    tokenizer = _vllm_tokenizer("tekken", tmp_path)
    assert request_renderer(tokenizer, None, GateConfig(), 4096).splice  # type: ignore[attr-defined]
    breaking = request_renderer(tokenizer, None, GateConfig(on_render_mismatch="break"), 4096)
    assert not breaking.splice  # type: ignore[attr-defined]
