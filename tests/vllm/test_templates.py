"""Five template families on the real engine: calls stay on one chain, rows are the engine's ids.

Each family plays a multi-turn rollout through the gate with the real ``openai`` client
(its template passed per request), real tool calls where the family renders them (vLLM's
``hermes`` parser, calls forced through guided decoding, results as ``role: "tool"``),
and reasoning forced into the Qwen3 family's turns with a regex. The rows are compared
with the ids and logprobs vLLM itself returned (``return_token_ids``), call by call. Each
test prints one line of the template table (``pytest -s``): calls, calls on the terminal
chain, splices by cause, breaks by cause.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from tests.vllm._helpers import client, close_and_reassemble
from tests.vllm._templates import FAMILIES
from tokcap.demo import TOOLS, forced_tool_calls, tool_result
from tokcap_core.ledger import Staged, manifest_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REASONING = {
    "structured_outputs": {
        "regex": r"<think>\n[a-z]{1,6}( [a-z]{1,6}){0,2}\n</think>\n\n[a-z]{1,6}( [a-z]{1,6}){0,2}"
    }
}
"""Qwen3-style turns: a reasoning block, then the answer (the random model fills it in)."""


@dataclass(frozen=True, slots=True)
class Family:
    """How the harness talks to a family: tools or plain user turns, forced shapes."""

    template: str
    tools: bool
    turns: int = 4
    reasoning: bool = False


SETUPS = {
    "chatml-tools (Qwen2.5)": Family(FAMILIES["chatml-tools (Qwen2.5)"], tools=True),
    "qwen3 (strips earlier <think>)": Family(
        FAMILIES["qwen3 (strips earlier <think>)"], tools=False, reasoning=True
    ),
    "llama3 (<|eot_id|>, ipython)": Family(FAMILIES["llama3 (<|eot_id|>, ipython)"], tools=True),
    "mistral ([INST] text)": Family(FAMILIES["mistral ([INST] text)"], tools=False),
    "chatml {% generation %}": Family(FAMILIES["chatml {% generation %}"], tools=False),
}


@dataclass(slots=True)
class Seen:
    """One call as the harness saw it (the engine's own ids and logprobs)."""

    response_id: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    tool_calls: int


@dataclass(slots=True)
class Rollout:
    calls: list[Seen] = field(default_factory=list)


async def _play(server: Any, rollout_id: str, family: Family) -> Rollout:
    out = Rollout()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 17 + 25?"},
    ]
    async with client(server, rollout_id) as c:
        for turn in range(family.turns):
            extra: dict[str, Any] = {"return_token_ids": True, "chat_template": family.template}
            kwargs: dict[str, Any] = {}
            forced = family.tools and turn < family.turns - 1
            if family.tools:
                kwargs = {"tools": list(TOOLS), "tool_choice": "auto"}
            if forced:
                extra.update(forced_tool_calls(TOOLS, 2 if turn == 0 else 1))
            if family.reasoning:
                extra.update(REASONING)
            r = await c.chat.completions.create(
                model=server.model,
                messages=messages,
                max_tokens=256 if forced or family.reasoning else 12,
                temperature=1.0,
                seed=1000 + turn,
                logprobs=True,
                extra_body=extra,
                **kwargs,
            )
            choice = r.choices[0]
            calls = [
                {
                    "id": t.id,
                    "type": "function",
                    "function": {"name": t.function.name, "arguments": t.function.arguments},
                }
                for t in choice.message.tool_calls or ()
            ]
            if forced:
                assert len(calls) == (2 if turn == 0 else 1), choice
            out.calls.append(
                Seen(
                    response_id=r.id,
                    prompt_ids=list(r.prompt_token_ids),
                    ids=list(choice.token_ids),
                    logprobs=[x.logprob for x in choice.logprobs.content],
                    tool_calls=len(calls),
                )
            )
            assistant: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
            if calls:
                assistant["tool_calls"] = calls
            messages.append(assistant)
            if calls:
                messages += [
                    {"role": "tool", "tool_call_id": t["id"], "content": tool_result(t)}
                    for t in calls
                ]
            else:
                messages.append({"role": "user", "content": f"and then? ({turn})"})
    return out


def _engine_parity(server: Any, rollout_id: str, rollout: Rollout, rows: list[Any]) -> int:
    """Check every row, call by call, against what the engine returned; count calls checked."""
    response_of = {
        e.event.call_id: e.event.response_id
        for e in manifest_of(server.gate.ledger(rollout_id)).entries
        if isinstance(e.event, Staged)
    }
    seen = {s.response_id: s for s in rollout.calls}
    checked = 0
    for row in rows:
        for span in row.call_spans:
            call = seen[response_of[span.call_id]]
            end = span.start + span.carry_len + span.gen_len
            assert list(row.input_ids[:end]) == call.prompt_ids + call.ids
            generated = list(row.logprobs[end - span.gen_len : end])
            assert all(
                math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
                for a, b in zip(generated, call.logprobs, strict=True)
            )
            checked += 1
    return checked


def _splices_counted(server: Any) -> float:
    """The gate's ``tokcap_splices`` counter, all causes."""
    metrics = server.gate.metrics()
    return sum(v for k, v in metrics.items() if k.startswith("tokcap/splices/"))


@pytest.mark.parametrize("name", list(SETUPS))
def test_template_family_on_the_real_engine(server: Any, name: str) -> None:
    family = SETUPS[name]
    rollout_id = "tpl-" + "".join(ch for ch in name.split()[0] if ch.isalnum())
    counted_before = _splices_counted(server)
    rollout = anyio.run(_play, server, rollout_id, family)
    receipt, rows, _ = close_and_reassemble(server, rollout_id, segments="all")
    assert receipt.ok, receipt.failure_reason
    checked = _engine_parity(server, rollout_id, rollout, rows)
    assert checked == len(rollout.calls)  # every call on some row, each equal to the engine's
    on_chain = len(receipt.segments[0])
    splices = Counter(receipt.splice_causes)
    breaks = Counter(receipt.break_causes)
    print(
        f"\nTEMPLATE-TABLE | {name} | calls {len(rollout.calls)} | on chain {on_chain} | "
        f"splices {dict(sorted(splices.items())) or '-'} | breaks {dict(breaks) or '-'} | "
        f"tool calls {sum(c.tool_calls for c in rollout.calls)}"
    )
    assert _splices_counted(server) - counted_before == len(receipt.splice_causes)
    if family.reasoning:  # the template follows Qwen3: earlier reasoning is dropped
        assert breaks == {"reasoning_stripped": len(rollout.calls) - 1}
        return
    assert not breaks
    assert on_chain == len(rollout.calls)
    if family.tools:
        assert splices["tool_call_format"] >= 1  # the parser re-serialised the forced calls
        assert rollout.calls[0].tool_calls == 2  # parallel calls in one turn
