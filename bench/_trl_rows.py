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
    "diff",
    "engine_ids",
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


@dataclass(slots=True)
class Diff:
    """Where a row leaves the engine's ids: the first position, and how many tokens differ."""

    first: int
    affected: int


def diff(row: Sequence[int], engine: Sequence[int]) -> Diff | None:
    """None when ``row`` is ``engine``; else the first differing position and the number of
    positions that differ (aligned), plus the length difference."""
    if list(row) == list(engine):
        return None
    common = min(len(row), len(engine))
    first = next((i for i in range(common) if row[i] != engine[i]), common)
    affected = sum(row[i] != engine[i] for i in range(common)) + abs(len(row) - len(engine))
    return Diff(first, affected)


def engine_ids(call: EngineCall) -> list[int]:
    """What the engine's row for a turn is: its prompt, then what it generated."""
    return [*call.prompt_ids, *call.output_ids]


@dataclass(slots=True)
class TrlReplay:
    """TRL's rows for one conversation, what each is compared with, and its drift tally."""

    rows: list[list[int]]
    engine: list[list[int]]
    """For each row, the engine's ids of the turn the row ends with."""
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
    ends = {tuple([*t.prompt_ids, *t.output_ids]): k for k, t in enumerate(turns)}
    rows = [list(s.input_ids) for s in sequences]
    engine = [engine_ids(conversation.calls[ends.get(tuple(r), len(turns) - 1)]) for r in rows]
    return TrlReplay(rows, engine, tally, len(turns))
