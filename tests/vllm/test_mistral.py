"""Mistral-family models served as their model cards ask, on the real engine, captured.

One vLLM CPU engine per tokenizer ``mistral_common`` ships (Tekken 240911, SentencePiece
v3), each next to a tiny random ``MistralForCausalLM`` of matching vocabulary, behind
``--tokenizer-mode mistral --enable-auto-tool-choice --tool-call-parser mistral``; the
engines start one after the other (the module fixture is finalised before the next
starts). The harness is the real ``openai`` client: it offers tools, echoes the returned
``tool_calls`` (Mistral's 9-character ids) and answers with ``role: "tool"`` messages.

The random model is made to call tools the way vLLM itself constrains output
(`tokcap.tiny.force_tool_calls`): a regex through ``structured_outputs``
(xgrammar on CPU; vLLM declares no special tokens to it for Mistral tokenizers, so
``[TOOL_CALLS]`` may match as the control token) plus a ``logit_bias`` on the
``[TOOL_CALLS]`` control token, so the model emits Mistral's own format: ``[TOOL_CALLS]``
``[{"name": ..., "arguments": {...}}]`` ``</s>``, parsed by vLLM's mistral tool parser.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.vllm._helpers import (
    VLLM_ARGS,
    client,
    close_and_reassemble,
    events,
    gate_server,
)
from tokcap.tiny import force_tool_calls, tiny_mistral, tool_calls_token_id
from tokcap_core.ledger import Admitted
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
CITY = r'\{"city": "[a-z]{2,7}"\}'
ANSWER = r"[a-z]{2,7}( [a-z]{2,7}){1,3}"
"""A short plain answer (forced too: a random model's free text may hold any control token)."""


@pytest.fixture(scope="module", params=["tekken", "spm"])
def mistral(request: pytest.FixtureRequest) -> Iterator[tuple[str, InProcessServer]]:
    kind = request.param
    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    model, mistral_args = tiny_mistral(cache, tokenizer=kind)
    with gate_server(model, [*VLLM_ARGS, *mistral_args]) as srv:
        yield kind, srv


async def _call(
    c: Any,
    srv: InProcessServer,
    messages: list[dict[str, Any]],
    *,
    calls: int = 0,
    tools: bool = True,
) -> dict[str, Any]:
    """One chat call: ``calls`` forced tool calls in Mistral's format, or a short answer."""
    extra: dict[str, Any] = {"return_token_ids": True}
    if calls:
        names = {t["function"]["name"]: CITY for t in TOOLS}
        extra.update(force_tool_calls(Path(srv.model), names, calls=calls))
    else:
        extra["structured_outputs"] = {"regex": ANSWER}
    r = await c.chat.completions.create(
        model=srv.model,
        messages=messages,
        tools=TOOLS if tools else None,
        max_tokens=96,
        temperature=1.0,
        seed=7,
        logprobs=True,
        extra_body=extra,
    )
    choice = r.choices[0]
    reply: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        reply["tool_calls"] = [
            {
                "id": t.id,
                "type": "function",
                "function": {"name": t.function.name, "arguments": t.function.arguments},
            }
            for t in choice.message.tool_calls
        ]
    return {
        "prompt_ids": list(r.prompt_token_ids),
        "ids": list(choice.token_ids),
        "logprobs": [x.logprob for x in choice.logprobs.content],
        "finish": choice.finish_reason,
        "reply": reply,
    }


def _tool_results(reply: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for call in reply["tool_calls"]:
        city = json.loads(call["function"]["arguments"])["city"]
        content = json.dumps({"city": city, call["function"]["name"]: "sunny, 21C, 14:05"})
        out.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return out


def _assert_token_exact(seen: list[dict[str, Any]], row: Any, staged: dict[str, Any]) -> None:
    """The row is exactly what the engine saw and made; every staged call is vLLM's own
    prompt tail and output, with vLLM's own logprobs."""
    last = seen[-1]
    assert list(row.input_ids) == last["prompt_ids"] + last["ids"]
    calls = sorted(staged.values(), key=lambda s: s.call_id)
    assert len(calls) == len(seen)
    for call, turn in zip(calls, seen, strict=True):
        assert list(call.tokens) == turn["prompt_ids"][call.prefix_len :] + turn["ids"]
        assert call.gen_len == len(turn["ids"])
        for mine, theirs in zip(call.logprobs, turn["logprobs"], strict=True):
            assert math.isclose(mine, theirs, rel_tol=1e-6, abs_tol=1e-6)
    generated = [i for i, m in enumerate(row.loss_mask) if m]
    expected = [lp for turn in seen for lp in turn["logprobs"]]
    assert len(generated) == len(expected)
    for pos, lp in zip(generated, expected, strict=True):
        assert math.isclose(row.logprobs[pos], lp, rel_tol=1e-6, abs_tol=1e-6)


def test_tool_call_rollout_is_one_verified_chain(mistral: tuple[str, InProcessServer]) -> None:
    """System + user, a tool call, two parallel tool calls, a final answer: every call on
    one chain (each tool-call turn a ``tool_call_format`` splice: Mistral's history carries
    call ids the model never generates), verified, token-exact against vLLM's own ids and
    logprobs; the first prompt is exactly vLLM's own rendering of the request."""
    kind, srv = mistral
    rollout = f"mistral-tools-{kind}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "Weather and time in Paris and Rome?"},
    ]

    async def run() -> list[dict[str, Any]]:
        seen = []
        async with client(srv, rollout) as c:
            for calls in (1, 2, 0):
                turn = await _call(c, srv, messages, calls=calls)
                seen.append(turn)
                messages.append(turn["reply"])
                if "tool_calls" in turn["reply"]:
                    messages.extend(_tool_results(turn["reply"]))
        return seen

    seen = anyio.run(run)
    assert [len(t["reply"].get("tool_calls", [])) for t in seen] == [1, 2, 0]
    for turn in seen[:2]:
        assert turn["ids"][0] == tool_calls_token_id(Path(srv.model))
        assert turn["finish"] == "tool_calls"
        assert all(len(t["id"]) == 9 and t["id"].isalnum() for t in turn["reply"]["tool_calls"])
    assert seen[2]["reply"]["content"]

    admitted = [e for e in events(srv, rollout) if isinstance(e, Admitted)]
    assert [(a.parent_id, a.formation, a.splice_cause) for a in admitted] == [
        (None, "root", None),
        ("c000001", "splice", "tool_call_format"),
        ("c000002", "splice", "tool_call_format"),
    ]
    receipt, rows, staged = close_and_reassemble(srv, rollout)
    assert receipt.ok
    assert [c.call_id for c in receipt.segments[0]] == ["c000001", "c000002", "c000003"]
    (row,) = rows
    _assert_token_exact(seen, row, staged)

    plain = httpx.post(
        f"{srv.base_url}/v1/chat/completions",
        json={
            "model": srv.model,
            "messages": messages[:2],
            "tools": TOOLS,
            "max_tokens": 1,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert plain.status_code == 200
    assert plain.json()["prompt_token_ids"] == seen[0]["prompt_ids"]


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
def test_a_new_user_turn(mistral: tuple[str, InProcessServer], tools: bool) -> None:
    """Without tools a second user turn continues the chain; with tools Mistral's v3
    tokenizers move the tool list to the *last* user message, re-rendering history, so
    the second call is a new root (``template_unstable``), exactly as vLLM renders it."""
    kind, srv = mistral
    rollout = f"mistral-users-{kind}-{tools}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say two words."}]

    async def run() -> list[dict[str, Any]]:
        seen = []
        async with client(srv, rollout) as c:
            for follow in ("Two more.", None):
                turn = await _call(c, srv, messages, tools=tools)
                seen.append(turn)
                if follow is not None:
                    messages.extend([turn["reply"], {"role": "user", "content": follow}])
        return seen

    seen = anyio.run(run)
    admitted = [e for e in events(srv, rollout) if isinstance(e, Admitted)]
    receipt, rows, staged = close_and_reassemble(srv, rollout, segments="all")
    assert receipt.ok
    if tools:
        assert (admitted[1].parent_id, admitted[1].break_cause) == (None, "template_unstable")
        assert len(receipt.segments) == 2
    else:
        assert admitted[1].parent_id == "c000001"
        # the forced answer has no stray whitespace or control token; at most its text is
        # tokenised otherwise than mistral_common encodes it
        assert (admitted[1].formation, admitted[1].splice_cause) in (
            ("extend", None),
            ("splice", "other"),
        )
        assert [c.call_id for c in receipt.segments[0]] == ["c000001", "c000002"]
        (row,) = rows
        _assert_token_exact(seen, row, staged)
    for turn, call in zip(seen, sorted(staged.values(), key=lambda s: s.call_id), strict=True):
        assert list(call.tokens) == turn["prompt_ids"][call.prefix_len :] + turn["ids"]


def test_a_chat_template_is_refused_at_the_first_call(mistral: tuple[str, InProcessServer]) -> None:
    """A template the gate cannot apply in mistral mode is a typed 400 at the first call,
    and nothing reaches the ledger."""
    _, srv = mistral
    r = httpx.post(
        f"{srv.rollout_url('mistral-template')}/chat/completions",
        json={
            "model": srv.model,
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template": "{{ messages[0]['content'] }}",
            "max_tokens": 4,
        },
        timeout=120,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "chat_template_unsupported"
    assert "mistral-template" not in srv.gate.rollouts()
