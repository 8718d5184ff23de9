"""The comparison functions of ``bench/bench_trl.py`` (``bench/_trl_rows.py``), engine-free.

Two turns of an agent conversation are built by hand the way a gate runs them: the first
prompt rendered by the template, a forced tool call as the model might write it, then the
second prompt as the engine saw it (the first turn's exact ids, then the template's tool
answer and generation prompt). TRL 1.16's own per-turn steps and reconciler (the bench's
`trl_replay`) re-render the history: a tool call written with the template's own spacing
stays CLEAN and its row is the engine's ids; one written with other spacing is REALIGNed,
and the row differs from the engine's ids exactly where the call was.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benches import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``bench/_trl_rows.py``, the bench's engine-free half (scripts import it by bare name)."""
    return load_bench("_trl_rows")


@pytest.fixture(scope="module")
def tokenizer(bench: ModuleType) -> Any:
    from tokcap.tiny import build_tiny_model

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return bench.trl_tokenizer(build_tiny_model(cache / "dense", kind="dense"))


def _conversation(bench: ModuleType, tokenizer: Any, arguments: str) -> Any:
    """Two engine calls: a tool call written as ``arguments``, then a text answer."""
    tools = [dict(t) for t in bench.TOOLS]
    question = "What is 3 + 4?"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": bench.SYSTEM},
        {"role": "user", "content": question},
    ]
    first = tokenizer.apply_chat_template(
        messages, return_dict=False, add_generation_prompt=True, tools=tools
    )
    call = f'<tool_call>\n{{"name": "calc", "arguments": {arguments}}}\n</tool_call><|im_end|>'
    output = tokenizer.encode(call, add_special_tokens=False)
    # what the template adds after the assistant turn: the tool answer, the generation prompt
    answer = "\n<|im_start|>user\n<tool_response>\n3 + 4 = 7\n</tool_response><|im_end|>\n"
    second = [*first, *output, *tokenizer.encode(answer + "<|im_start|>assistant\n")]
    final = tokenizer.encode("7<|im_end|>", add_special_tokens=False)
    conversation = bench.Conversation("r0", "g0", question)
    conversation.calls = [
        bench.EngineCall(first, output, [-0.5] * len(output)),
        bench.EngineCall(second, final, [-0.5] * len(final)),
    ]
    return conversation


def test_the_templates_own_spacing_is_clean_and_equal(bench: ModuleType, tokenizer: Any) -> None:
    conversation = _conversation(bench, tokenizer, '{"a": 3, "op": "+", "b": 4}')
    replay = bench.trl_replay(tokenizer, conversation)
    assert replay.turns == 2
    assert replay.tally["clean"] == 1
    assert replay.tally["realign"] == 0
    [row] = replay.rows
    assert replay.turns_of_row == [[(c.prompt_ids, c.output_ids) for c in conversation.calls]]
    assert bench.diff(row, replay.turns_of_row[0]) is None


def test_other_spacing_is_realigned_and_differs_where_the_call_was(
    bench: ModuleType, tokenizer: Any
) -> None:
    conversation = _conversation(bench, tokenizer, '{"a":3,\n"op": "+", "b":  4}')
    replay = bench.trl_replay(tokenizer, conversation)
    assert replay.tally["realign"] == 1
    assert replay.tally["fork"] == 0
    [row] = replay.rows
    first, last = conversation.calls
    trl_prompt, output = replay.turns_of_row[0][-1]
    assert row == [*trl_prompt, *last.output_ids]  # realigned onto TRL's own last prompt
    assert trl_prompt != last.prompt_ids  # which re-rendered the tool call
    found = bench.diff(row, replay.turns_of_row[0])
    assert found is not None
    start, end = len(first.prompt_ids), len(first.prompt_ids) + len(first.output_ids)
    assert start <= found.first < end  # inside the tool call the engine generated
    assert 0 < found.affected <= len(first.output_ids)  # only that turn's tokens moved
    assert bench.diff(row, [(trl_prompt, output)]) is None  # the last turn is intact


def test_diff_counts_generated_tokens_not_at_their_place(bench: ModuleType) -> None:
    turns = [([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6])]
    assert bench.diff([1, 2, 3, 4, 5, 6], turns) is None
    assert bench.diff([1, 2, 9, 4, 5, 6], turns) == bench.Diff(first=2, affected=1)
    assert bench.diff([1, 7, 3, 4, 5, 6], turns) == bench.Diff(first=1, affected=0)
    assert bench.diff([1, 2, 3, 4, 5], turns) == bench.Diff(first=5, affected=1)
