"""The demo's agent harness: a black box that only speaks the OpenAI API.

A tool-using arithmetic task. The harness offers a ``calc`` tool in its system prompt
(``CALL calc(<expression>)``), feeds the tool's output back as a ``role: "tool"``
message, and scores the final assistant message. The tiny random model writes
gibberish, so most tool calls are "not found" observations: what matters is that each
episode is several real chat calls through the gate, exactly as an agent makes them.

Behaviours, one per rollout slot of a group (the rest are ``plain``):

- ``response_id``: the scorer's close witness is the scored response id;
- ``content``: the close witness is only a fingerprint of the scored content;
- ``declared``: the harness declares the terminal call (by response id) before closing;
- ``rewrite``: half-way through, the harness summarises earlier turns into one user
  message (context compaction), so the rollout's history is a forest with a break.

Each call asks the server for ``return_token_ids``: the demo's independent check
compares every reassembled row with the ids the engine itself reported to the harness.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

__all__ = ["BEHAVIOURS", "Behaviour", "EngineCall", "Episode", "Task", "run_episode"]

Behaviour = Literal["response_id", "content", "declared", "rewrite", "plain"]
BEHAVIOURS: tuple[Behaviour, ...] = ("response_id", "content", "declared", "rewrite")
"""Behaviours of rollout slots 0..3 of every group; later slots are ``plain``."""

SYSTEM = (
    "You solve arithmetic with a calculator. To use it, write CALL calc(<expression>). "
    "When you know the result, write ANSWER <number>."
)
_CALL = re.compile(r"CALL\s+calc\(([^)]*)\)")
_NUMBER = re.compile(r"-?\d+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


@dataclass(frozen=True, slots=True)
class Task:
    """``a op b``: the prompt and the exact answer."""

    a: int
    b: int
    op: str

    @classmethod
    def for_group(cls, seed: int, group: int) -> Task:
        """The group's task: every rollout of a group gets the same one."""
        rng = random.Random(f"{seed}/{group}")
        return cls(rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*"))

    @property
    def prompt(self) -> str:
        """The user message."""
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        """The correct result."""
        return int(calc(f"{self.a} {self.op} {self.b}"))


@dataclass(slots=True)
class EngineCall:
    """What the server returned for one chat call (ids as the engine reported them)."""

    response_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    content: str
    finish_reason: str


@dataclass(slots=True)
class Episode:
    """One rollout as the harness saw it: its calls, transcript, reward and witnesses."""

    rollout_id: str
    group: int
    behaviour: Behaviour
    task: Task
    calls: list[EngineCall] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The final transcript, last assistant message included (what a re-tokeniser renders)."""
    reward: float = 0.0

    @property
    def final(self) -> EngineCall:
        """The scored call (the last one)."""
        return self.calls[-1]


def calc(expression: str) -> float:
    """Evaluate ``+ - *`` over integers (the tool); `ValueError` for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}") from e

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        raise ValueError(f"unsupported expression {expression!r}")

    return ev(tree.body)


def tool_output(content: str) -> str:
    """The calc tool's reply to an assistant message."""
    match = _CALL.search(content)
    if match is None:
        return "error: no tool call found; write CALL calc(<expression>) or ANSWER <number>"
    try:
        return f"calc({match.group(1)}) = {calc(match.group(1)):g}"
    except ValueError as e:
        return f"error: {e}"


def score(task: Task, content: str) -> float:
    """1.0 for the right answer, plus a small brevity bonus so wrong answers still rank.

    Deterministic in the content: the last integer in the message is the answer given.
    """
    numbers = _NUMBER.findall(content)
    correct = 1.0 if numbers and int(numbers[-1]) == task.answer else 0.0
    return correct + 0.1 * max(0.0, 1.0 - len(content) / 200.0)


async def run_episode(
    client: openai.AsyncOpenAI,
    model: str,
    episode: Episode,
    *,
    turns: int,
    max_tokens: int,
    seed: int,
) -> Episode:
    """Play ``turns`` chat calls of ``episode``; fills its calls, transcript and reward."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": episode.task.prompt},
    ]
    for turn in range(turns):
        if episode.behaviour == "rewrite" and turn == max(1, turns // 2):
            messages = _compact(messages, episode.task)
        response = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed * 1000 + turn,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        choice = response.choices[0]
        content = choice.message.content or ""
        episode.calls.append(
            EngineCall(
                response_id=response.id,
                prompt_token_ids=list(getattr(response, "prompt_token_ids", None) or []),
                token_ids=list(getattr(choice, "token_ids", None) or []),
                logprobs=[
                    t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []
                ],
                content=content,
                finish_reason=choice.finish_reason or "",
            )
        )
        messages.append({"role": "assistant", "content": content})
        if turn < turns - 1:
            messages.append(
                {"role": "tool", "tool_call_id": f"calc-{turn}", "content": tool_output(content)}
            )
    episode.messages = messages
    episode.reward = score(episode.task, episode.final.content)
    return episode


def _compact(messages: list[dict[str, Any]], task: Task) -> list[dict[str, Any]]:
    """Context compaction: everything after the system prompt becomes one summary message."""
    tools = sum(1 for m in messages if m["role"] == "tool")
    summary = f"{task.prompt} (Summary: {tools} earlier calculator turns gave no answer yet.)"
    return [messages[0], {"role": "user", "content": summary}]
