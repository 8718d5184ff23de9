"""The TRL side of ``bench/bench_trl.py``: TRL 1.16's own per-turn steps on a conversation's
engine outputs, and how a row is compared with the engine's ids (engine-free, so that
tests/test_bench_trl.py can check it without starting anything)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokcap.demo import CHATML_TOOLS_TEMPLATE, TOOLS, tool_result

if TYPE_CHECKING:  # the compose room starts vLLM imports: the tests of this module skip it
    from tokcap.compose import Finished

__all__ = [
    "FORK_THRESHOLD",
    "SYSTEM",
    "Conversation",
    "Diff",
    "EngineCall",
    "TrlReplay",
    "Turn",
    "diff",
    "engine_turns",
    "trl_replay",
    "trl_tokenizer",
]

SYSTEM = (
    "You solve arithmetic with the calc tool. When you know the result, answer with the number."
)
FORK_THRESHOLD = 1024
"""TRL's ``fork_threshold_tokens`` default (``AsyncGRPOConfig``)."""


@dataclass(slots=True)
class EngineCall:
    """One chat call as the engine reported it: the prompt it ran on, what it generated."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class Conversation:
    """One rollout of the task, played through the gate."""

    rollout_id: str
    group_id: str
    question: str
    calls: list[EngineCall] = field(default_factory=list)
    finished: Finished | None = None


Turn = tuple[list[int], list[int]]
"""One engine turn as a row should hold it: the prompt the engine ran on, what it generated."""


@dataclass(slots=True)
class Diff:
    """Where a row leaves the engine's ids: the first differing position, and how many of
    the tokens the engine generated are not in the row as generated."""

    first: int
    affected: int


def diff(row: Sequence[int], turns: Sequence[Turn]) -> Diff | None:
    """None when every turn's prompt and output are, token for token, a prefix of ``row``
    (the row holds each generated token where and after what the engine produced it);
    else the first position where one is not, and the count of generated tokens missing
    from their place (a position that differs, or that the row does not reach)."""
    first: int | None = None
    affected = 0
    for prompt, output in turns:
        expected = [*prompt, *output]
        common = min(len(row), len(expected))
        where = next((i for i in range(common) if row[i] != expected[i]), None)
        if where is None and len(row) < len(expected):
            where = len(row)
        if where is not None:
            first = where if first is None else min(first, where)
        start = len(prompt)
        affected += sum(
            start + i >= len(row) or row[start + i] != token for i, token in enumerate(output)
        )
    return None if first is None else Diff(first, affected)


def engine_turns(conversation: Conversation) -> list[Turn]:
    """The conversation's turns as the engine reported them."""
    return [(c.prompt_ids, c.output_ids) for c in conversation.calls]


@dataclass(slots=True)
class TrlReplay:
    """TRL's rows for one conversation, the turns each row covers, and TRL's drift tally."""

    rows: list[list[int]]
    turns_of_row: list[list[Turn]]
    """For each row, its turns as TRL sent them to the engine (TRL's prompt, the output)."""
    tally: dict[str, float]
    turns: int


def trl_tokenizer(model: Path) -> Any:
    """The tiny model's tokenizer as a TRL user with a Qwen-layout tool template sets it up:
    the template the gate serves, TRL's Qwen3 response template for ``parse_response``."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    tokenizer.response_template = qwen3_template
    return tokenizer


def trl_replay(tokenizer: Any, conversation: Conversation) -> TrlReplay:
    """TRL 1.16's async worker's per-turn steps on ``conversation``'s engine outputs (see the
    module docstring), then its reconciler: TRL's rows and what each should have been."""
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        parse_response,
    )

    with warnings.catch_warnings():  # a deliberate use of TRL 1.16's experimental worker,
        # which also warns that it was not tested with the locked vLLM (it is not run here)
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
        from trl.experimental.async_grpo.async_rollout_worker import (
            TurnRecord,
            _chain_to_sequences,
        )

    tools = [dict(t) for t in TOOLS]
    template = None
    if not is_chat_template_prefix_preserving(tokenizer):
        template = get_training_chat_template(tokenizer)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": conversation.question},
    ]
    turns: list[TurnRecord] = []
    for call in conversation.calls:
        prompt_ids = tokenizer.apply_chat_template(
            messages,
            return_dict=False,
            add_generation_prompt=True,
            tools=tools,
            chat_template=template,
        )
        assistant = parse_response(tokenizer, call.output_ids, prefix=prompt_ids, tools=tools)
        messages.append(assistant)
        turns.append(TurnRecord(prompt_ids, call.output_ids, call.logprobs))
        tool_calls = assistant.get("tool_calls")
        if tool_calls is None:
            break  # TRL's worker stops at the first turn without a tool call
        for c in tool_calls:
            args = c["function"].get("arguments", {})
            answer = tool_result({"function": {"arguments": json.dumps(args)}})
            messages.append({"role": "tool", "name": c["function"]["name"], "content": answer})
    sequences, tally = _chain_to_sequences(turns, conversation.rollout_id, FORK_THRESHOLD)
    rows = [list(s.input_ids) for s in sequences]
    # a row ends with its last turn's prompt and output (CLEAN appends, REALIGN overwrites the
    # drifted tail with the new prompt), and a FORK starts the next row: rows cover runs of turns
    ends = {tuple([*t.prompt_ids, *t.output_ids]): k for k, t in enumerate(turns)}
    covered, start = [], 0
    for row in rows:
        end = ends.get(tuple(row), len(turns) - 1)
        covered.append([(t.prompt_ids, t.output_ids) for t in turns[start : end + 1]])
        start = end + 1
    return TrlReplay(rows, covered, tally, len(turns))
