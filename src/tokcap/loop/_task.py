"""``tokcap train``'s task and harness: a black box that asks for digits over the OpenAI API.

Each rollout is a short chat: the user asks for a long number, the model answers, the
user asks for more digits, the model answers again (``turns`` calls, each a real chat
call through the gate, the second one extending the first). The scorer sees text only:
the reward is the share of the answers' non-space characters that are digits, in [0, 1].
A random tiny model writes almost no digits (about 0.2 %); a policy-gradient loop on
these rewards teaches it to write mostly digits within a few dozen steps.

The scorer's witnesses follow the demo: per rollout slot, the scored response id, the
scored content, a declared terminal, or none (the gate's deepest-chain choice).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

__all__ = ["WITNESSES", "DigitsEpisode", "Witness", "digit_share", "play_digits"]

Witness = Literal["response_id", "content", "declared", "none"]
WITNESSES: tuple[Witness, ...] = ("response_id", "content", "declared", "none")
"""How the scorer names the scored call, by rollout slot (cycled)."""

SYSTEM = "You write numbers. Answer with digits only."
"""The system prompt of every chat the loop's harness plays."""
MORE = "More digits, please."


def digit_share(text: str) -> float:
    """The share of ``text``'s non-space characters that are digits (0.0 for none)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def group_prompt(seed: int, group: int) -> str:
    """The user's first message for every rollout of a group."""
    rng = random.Random(f"{seed}/{group}")
    return f"Write a long number that starts with {rng.randint(10, 99)}."


@dataclass(slots=True)
class DigitsEpisode:
    """One rollout as the harness saw it."""

    rollout_id: str
    group_id: str
    witness: Witness
    prompt: str
    response_ids: list[str] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)
    reward: float = 0.0


async def play_digits(
    client: openai.AsyncOpenAI,
    model: str,
    episode: DigitsEpisode,
    *,
    turns: int,
    max_tokens: int,
    seed: int,
) -> DigitsEpisode:
    """Play ``turns`` chat calls (sampled at temperature 1); fill the answers and the reward."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": episode.prompt},
    ]
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": MORE})
        response = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            seed=seed * 100 + turn,
        )
        content = response.choices[0].message.content or ""
        episode.response_ids.append(response.id)
        episode.contents.append(content)
        messages.append({"role": "assistant", "content": content})
    episode.reward = digit_share("".join(episode.contents))
    return episode
