"""The Responses API and Anthropic Messages on the real engine, driven by the real clients.

A rollout driven by the ``openai`` client's ``responses`` API and one driven by the
``anthropic`` client each capture several turns with tool calls, verify, and reassemble
into one row whose ids and logprobs are the engine's: every call's prompt and output
lengths are the ones vLLM itself reported (``usage``), the chat turn's ids are the ones vLLM
returned (``return_token_ids``), and the logprobs are the ones vLLM returned where the API
returns them. A third rollout mixes the APIs (Messages, chat, Messages) on one chain. Then
the hostile cases on the new endpoints.

The tiny random model calls tools only when forced (``forced_tool_calls``: a structural
tag in vLLM's ``structured_outputs``): the Responses API takes that field; the Messages API
takes it as the gate's extension (in the ``anthropic`` client's ``extra_body``), so the
model's own output comes back as ``tool_use`` blocks, parsed by the server's ``hermes``
parser.
"""

from __future__ import annotations

import json
import math
from typing import Any

import anthropic
import anyio
import httpx
import pytest

from tests.vllm._helpers import client, close_and_reassemble, events
from tests.vllm.test_hostile import _assert_serving, _code, _verified
from tokcap.demo import TOOLS, forced_tool_calls, tool_result
from tokcap_core.ledger import Admitted, Failed, Staged
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [
    {
        "name": "calc",
        "description": TOOLS[0]["function"]["description"],
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
]
SYSTEM = "You add numbers."
_PNG = {"type": "base64", "media_type": "image/png", "data": "AAAA"}


def _anthropic(server: InProcessServer, rollout_id: str) -> anthropic.AsyncAnthropic:
    """The real Anthropic client: its base URL is the rollout's, without ``/v1``."""
    base = server.rollout_url(rollout_id).removesuffix("/v1")
    return anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)


def _tokenizer(server: InProcessServer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model)


def _staged_by_response(server: InProcessServer, rollout_id: str) -> dict[str, str]:
    return {e.response_id: e.call_id for e in events(server, rollout_id) if isinstance(e, Staged)}


def _assert_engine_lengths(
    rows: list[Any], staged: dict[str, Any], usage: list[tuple[int, int]]
) -> None:
    """One row; call ``i`` saw ``usage[i][0]`` prompt ids and made ``usage[i][1]`` (vLLM's
    own counts), and the row holds exactly those ids, generated ones under the loss mask."""
    (row,) = rows
    calls = sorted(staged.values(), key=lambda s: s.call_id)
    assert len(calls) == len(usage)
    cum = 0
    for call, (prompt_len, gen_len) in zip(calls, usage, strict=True):
        assert call.prefix_len + call.carry_len == prompt_len
        assert call.gen_len == gen_len
        assert call.prefix_len == cum  # each call extends the one before
        cum = prompt_len + gen_len
    assert len(row.input_ids) == cum
    assert sum(row.loss_mask) == sum(g for _, g in usage)


def _assert_a_tool_loop_on_one_chain(
    server: InProcessServer, rollout_id: str, answers: list[Any]
) -> dict[str, Any]:
    """Four calls on one chain, the two after the forced tool calls spliced by their format,
    each answer staged as its own call; verified, the row holding the lengths vLLM reported
    (each answer's ``usage``). The staged calls, by call id."""
    admitted = [e for e in events(server, rollout_id) if isinstance(e, Admitted)]
    assert [a.parent_id for a in admitted] == [None, "c000001", "c000002", "c000003"]
    assert [a.splice_cause for a in admitted][1:3] == ["tool_call_format"] * 2
    assert _staged_by_response(server, rollout_id) == {
        a.id: f"c00000{i}" for i, a in enumerate(answers, 1)
    }
    receipt, rows, staged = close_and_reassemble(server, rollout_id)
    assert receipt.ok, receipt.failure_reason
    usage = [(a.usage.input_tokens, a.usage.output_tokens) for a in answers]
    _assert_engine_lengths(rows, staged, usage)
    return staged


async def _responses_rollout(server: InProcessServer, rollout_id: str) -> list[Any]:
    """Four turns: two forced parallel calls (text input), their outputs by
    ``previous_response_id`` with one forced call (streamed), its output the same way, then
    a follow-up sent statelessly with the whole history as input items."""
    answers: list[Any] = []
    async with client(server, rollout_id) as c:
        common: dict[str, Any] = {"model": server.model, "tools": RESPONSES_TOOLS}
        first = await c.responses.create(
            input="What is 17 + 25?",
            instructions=SYSTEM,
            max_output_tokens=300,
            temperature=1.0,
            extra_body=forced_tool_calls(TOOLS, 2),
            **common,
        )
        answers.append(first)
        outputs = [
            {"type": "function_call_output", "call_id": o.call_id, "output": tool_result(_fn(o))}
            for o in first.output
            if o.type == "function_call"
        ]
        async with c.responses.stream(
            input=outputs,
            previous_response_id=first.id,
            instructions=SYSTEM,
            max_output_tokens=300,
            temperature=1.0,
            extra_body=forced_tool_calls(TOOLS, 1),
            **common,
        ) as stream:
            second = await stream.get_final_response()
        answers.append(second)
        (call,) = [o for o in second.output if o.type == "function_call"]
        third = await c.responses.create(
            input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
            ],
            previous_response_id=second.id,
            instructions=SYSTEM,
            max_output_tokens=8,
            include=["message.output_text.logprobs"],
            top_logprobs=0,
            **common,
        )
        answers.append(third)
        history: list[Any] = [{"role": "user", "content": "What is 17 + 25?"}]
        history += [o.model_dump(exclude_none=True) for o in first.output] + outputs
        history += [o.model_dump(exclude_none=True) for o in second.output]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
        history += [o.model_dump(exclude_none=True) for o in third.output]
        history.append({"role": "user", "content": "Sure?"})
        answers.append(
            await c.responses.create(
                input=history, instructions=SYSTEM, max_output_tokens=6, **common
            )
        )
    return answers


def _fn(item: Any) -> dict[str, Any]:
    return {"function": {"name": item.name, "arguments": item.arguments}}


def test_the_responses_client_captures_a_tool_loop_on_one_chain(server: InProcessServer) -> None:
    answers = anyio.run(_responses_rollout, server, "api-resp")
    assert sum(o.type == "function_call" for o in answers[0].output) == 2
    staged = _assert_a_tool_loop_on_one_chain(server, "api-resp", answers)
    third = staged["c000003"]
    (message,) = [o for o in answers[2].output if o.type == "message"]
    reported = [lp.logprob for lp in message.content[0].logprobs]
    assert third.gen_len - 1 <= len(reported) <= third.gen_len  # an ending eos has no text
    for mine, theirs in zip(third.logprobs, reported, strict=False):
        assert math.isclose(mine, theirs, rel_tol=1e-6, abs_tol=1e-6)
    tokenizer = _tokenizer(server)
    forced = tokenizer.decode(list(staged["c000001"].generated))
    for item in [o for o in answers[0].output if o.type == "function_call"]:
        assert item.name in forced


def _blocks(message: Any) -> dict[str, Any]:
    """An answer as the assistant message the next request sends back."""
    return {
        "role": "assistant",
        "content": [b.model_dump(exclude_none=True) for b in message.content],
    }


def _results(message: Any) -> dict[str, Any]:
    """The user message answering each ``tool_use`` block of ``message``."""
    uses = [b for b in message.content if b.type == "tool_use"]
    content = [
        {
            "type": "tool_result",
            "tool_use_id": b.id,
            "content": tool_result(
                {"function": {"name": b.name, "arguments": json.dumps(b.input)}}
            ),
        }
        for b in uses
    ]
    return {"role": "user", "content": content}


async def _messages_rollout(server: InProcessServer, rollout_id: str) -> list[Any]:
    """Four Messages turns: two forced parallel ``tool_use`` blocks, their results with one
    forced call (streamed), its result, then a follow-up."""
    seen: list[Any] = []
    common: dict[str, Any] = {"model": server.model, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 + 25?"}]
    async with _anthropic(server, rollout_id) as a:
        first = await a.messages.create(
            messages=messages, max_tokens=300, extra_body=forced_tool_calls(TOOLS, 2), **common
        )
        seen.append(first)
        messages += [_blocks(first), _results(first)]
        async with a.messages.stream(
            messages=messages, max_tokens=300, extra_body=forced_tool_calls(TOOLS, 1), **common
        ) as stream:
            second = await stream.get_final_message()
        seen.append(second)
        messages += [_blocks(second), _results(second)]
        third = await a.messages.create(messages=messages, max_tokens=6, **common)
        seen.append(third)
        messages += [_blocks(third), {"role": "user", "content": "Sure?"}]
        seen.append(await a.messages.create(messages=messages, max_tokens=6, **common))
    return seen


def test_the_anthropic_client_captures_a_tool_loop_on_one_chain(server: InProcessServer) -> None:
    before = server.gate.telemetry.as_dict().get("tokcap/calls_by_api/messages", 0.0)
    seen = anyio.run(_messages_rollout, server, "api-msgs")
    assert server.gate.telemetry.as_dict()["tokcap/calls_by_api/messages"] == before + 4
    assert [sum(b.type == "tool_use" for b in m.content) for m in seen[:2]] == [2, 1]
    assert [m.stop_reason for m in seen[:2]] == ["tool_use", "tool_use"]
    staged = _assert_a_tool_loop_on_one_chain(server, "api-msgs", seen)
    forced = _tokenizer(server).decode(list(staged["c000001"].generated))
    assert forced.count("<tool_call>") == 2  # the model's own output, parsed into the blocks
    assert [b.name for b in seen[0].content if b.type == "tool_use"] == ["calc", "calc"]


async def _anthropic_rollout(server: InProcessServer, rollout_id: str) -> list[Any]:
    """Messages (text), chat (a forced tool call), Messages streamed with the call and its
    result as ``tool_use`` / ``tool_result`` blocks, Messages again."""
    seen: list[Any] = []
    common: dict[str, Any] = {"model": server.model, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 + 25?"}]
    async with _anthropic(server, rollout_id) as a, client(server, rollout_id) as c:
        first = await a.messages.create(messages=messages, max_tokens=6, **common)
        seen.append(first)
        text = "".join(b.text for b in first.content if b.type == "text")
        messages += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {"role": "user", "content": "Use the calc tool."},
        ]
        chat = await c.chat.completions.create(
            model=server.model,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is 17 + 25?"},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Use the calc tool."},
            ],
            tools=list(TOOLS),
            tool_choice="auto",
            max_tokens=300,
            temperature=1.0,
            extra_body={"return_token_ids": True, **forced_tool_calls(TOOLS, 1)},
        )
        seen.append(chat)
        (call,) = chat.choices[0].message.tool_calls
        tool_use = {
            "type": "tool_use",
            "id": call.id,
            "name": call.function.name,
            "input": json.loads(call.function.arguments),
        }
        messages += [
            {"role": "assistant", "content": [tool_use]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": tool_result(call.model_dump()),
                    }
                ],
            },
        ]
        async with a.messages.stream(messages=messages, max_tokens=6, **common) as stream:
            third = await stream.get_final_message()
        seen.append(third)
        messages += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in third.content],
            },
            {"role": "user", "content": "Sure?"},
        ]
        seen.append(await a.messages.create(messages=messages, max_tokens=6, **common))
    return seen


def test_messages_and_a_chat_turn_capture_one_chain(server: InProcessServer) -> None:
    seen = anyio.run(_anthropic_rollout, server, "api-anth")
    admitted = [e for e in events(server, "api-anth") if isinstance(e, Admitted)]
    assert [a.parent_id for a in admitted] == [None, "c000001", "c000002", "c000003"]
    assert admitted[2].splice_cause == "tool_call_format"  # the tool_use block, re-rendered
    receipt, rows, staged = close_and_reassemble(server, "api-anth")
    assert receipt.ok, receipt.failure_reason
    chat = seen[1]
    usage = [
        (m.usage.input_tokens, m.usage.output_tokens)
        if i != 1
        else (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        for i, m in enumerate(seen)
    ]
    _assert_engine_lengths(rows, staged, usage)
    (row,) = rows
    assert list(row.input_ids[: len(chat.prompt_token_ids)]) == chat.prompt_token_ids
    assert list(staged["c000002"].generated) == chat.choices[0].token_ids
    assert _staged_by_response(server, "api-anth") == {
        m.id: f"c00000{i}" for i, m in enumerate(seen, 1)
    }


# ---- hostile clients on the new endpoints ------------------------------------------------


def _post(
    server: InProcessServer, rollout_id: str, api: str, body: Any, **kw: Any
) -> httpx.Response:
    with httpx.Client(timeout=120) as http:
        return http.post(f"{server.rollout_url(rollout_id)}/{api}", json=body, **kw)


def _responses_body(server: InProcessServer, **extra: Any) -> dict[str, Any]:
    return {"model": server.model, "input": "hi", "max_output_tokens": 3, **extra}


def test_previous_response_id_must_name_an_answered_call_of_the_same_rollout(
    server: InProcessServer,
) -> None:
    first = _post(server, "api-prev-a", "responses", _responses_body(server))
    assert first.status_code == 200, first.text
    named = first.json()["id"]
    other = _post(
        server, "api-prev-b", "responses", _responses_body(server, previous_response_id=named)
    )
    assert _code(other) == (400, "unknown_previous_response")
    assert "api-prev-b" not in server.gate.rollouts()
    unknown = _post(
        server, "api-prev-a", "responses", _responses_body(server, previous_response_id="resp_nope")
    )
    assert _code(unknown) == (400, "unknown_previous_response")
    child = _post(
        server, "api-prev-a", "responses", _responses_body(server, previous_response_id=named)
    )
    assert child.status_code == 200, child.text
    assert [e.parent_id for e in events(server, "api-prev-a") if isinstance(e, Admitted)] == [
        None,
        "c000001",
    ]
    assert _verified(server, "api-prev-a")


@pytest.mark.parametrize(
    ("api", "body", "code"),
    [
        ("responses", {"background": True}, "background_unsupported"),
        ("responses", {"tools": [{"type": "web_search"}]}, "tool_type_unsupported"),
        ("responses", {"truncation": "auto"}, "truncation_unsupported"),
        ("responses", {"input": 7}, "bad_body"),
        ("messages", {"messages": []}, "bad_body"),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "image", "source": _PNG}]}]},
            "unsupported_content",
        ),
    ],
)
def test_bad_input_on_the_new_endpoints_is_typed_and_leaves_nothing(
    server: InProcessServer, api: str, body: dict[str, Any], code: str
) -> None:
    rollout_id = f"api-bad-{api}-{code}"
    base = (
        _responses_body(server)
        if api == "responses"
        else {
            "model": server.model,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    answer = _post(server, rollout_id, api, {**base, **body})
    assert _code(answer) == (400, code)
    assert rollout_id not in server.gate.rollouts()
    with httpx.Client(timeout=120) as http:
        broken = http.post(f"{server.rollout_url(rollout_id)}/{api}", content=b'{"model": ')
    assert _code(broken) == (400, "bad_json")


def test_the_rollout_header_captures_the_new_endpoints(server: InProcessServer) -> None:
    """B4 turned around: ``/v1/messages`` and ``/v1/responses`` naming a rollout by header are
    captured (they were refused before), a seeded long prompt included (B5: the seed check
    of the captured path applies)."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        headers = {"x-tokcap-rollout-id": "api-header"}
        body = {
            "model": server.model,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert http.post("/v1/messages", json=body, headers=headers).status_code == 200
        long = _responses_body(server, input="word " * 700, seed=3, temperature=1.0)
        assert http.post("/v1/responses", json=long, headers=headers).status_code == 200
    assert [type(e).__name__ for e in events(server, "api-header")] == ["Admitted", "Staged"] * 2
    assert _verified(server, "api-header")


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_stream_the_client_leaves_is_uncommitted(server: InProcessServer, api: str) -> None:
    rollout_id = f"api-drop-{api}"
    if api == "messages":
        body: dict[str, Any] = {
            "model": server.model,
            "max_tokens": 2000,
            "stream": True,
            "messages": [{"role": "user", "content": "talk"}],
        }
    else:
        body = _responses_body(server, max_output_tokens=2000, stream=True, ignore_eos=True)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"{server.rollout_url(rollout_id)}/{api}"
            async with http.stream("POST", url, json=body) as response:
                async for _ in response.aiter_bytes():
                    break  # the first event, then hang up
        await anyio.sleep(2.0)

    anyio.run(main)
    evs = events(server, rollout_id)
    assert isinstance(evs[0], Admitted)
    assert not any(isinstance(e, Staged) for e in evs)
    (failed,) = [e for e in evs if isinstance(e, Failed)]
    assert not failed.served
    assert failed.reason.startswith("uncommitted_call")
    _assert_serving(server, rollout_id + "-after")
