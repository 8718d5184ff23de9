"""What a harness is to the adapter: a black box that plays one rollout against a URL.

The adapter opens each rollout on a gate and hands the harness an ``openai.AsyncOpenAI``
client whose base URL is that rollout's (``.../tokcap/rollouts/{id}/v1``) and the
`Episode` it plays (its prompt, ids, the model name). The harness talks to the model as
it would to any OpenAI-compatible server, as many calls as it likes, and returns the
rollout's reward (a float) or a `Scored` with the scorer's witness (the scored response's
id or content, which names the terminal call). It never sees token ids: the gate captured
them.

`chat_harness` is the default: a multi-turn chat where the environment answers each
model turn (a fixed message, or one computed from the answer) and a scorer turns the
answers into a reward.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import openai
from openai.types.chat import ChatCompletion

__all__ = ["Episode", "Harness", "Prompt", "Scored", "chat_harness", "prompt_messages"]

Prompt: TypeAlias = str | Sequence[Mapping[str, Any]]
"""A prompt as TRL passes it: plain text, or a conversation (a list of chat messages)."""


@attrs.frozen(kw_only=True)
class Episode:
    """One rollout a harness plays."""

    rollout_id: str
    """The rollout's id on its gate (the harness never needs it: the URL carries it)."""
    group_id: str
    """The rollouts of one prompt share a group (GRPO's baseline)."""
    index: int
    """Its position in the batch the trainer asked for."""
    prompt: Prompt
    """The prompt the trainer gave for it."""
    model: str
    """The model name to send in requests (what the gates serve)."""
    base_url: str
    """The rollout's OpenAI base URL on its gate."""


@attrs.frozen(kw_only=True)
class Scored:
    """A played rollout's score and what the scorer saw (witnesses name the terminal call)."""

    reward: float
    response_id: str | None = None
    """The id of the response that was scored (the gate's ``chatcmpl-...`` id)."""
    content: str | None = None
    """Or the scored content itself (the gate fingerprints it)."""


Harness: TypeAlias = Callable[[openai.AsyncOpenAI, Episode], Awaitable[Scored | float]]
"""``async harness(client, episode) -> Scored | float``: play ``episode`` through ``client``
(already pointed at the rollout's URL, no retries) and score it. A bare float is the
reward with no witness (the gate then picks the deepest chain as the terminal)."""


def prompt_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """The chat messages a prompt stands for: text becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]


def chat_harness(
    score: Callable[[Sequence[str]], float],
    *,
    turns: int = 1,
    reply: str | Callable[[str], str] = "Go on.",
    system: str | None = None,
    max_tokens: int = 64,
    temperature: float = 1.0,
    extra_body: Mapping[str, Any] | None = None,
    on_response: Callable[[Episode, ChatCompletion], object] | None = None,
) -> Harness:
    """The default harness: a ``turns``-call chat on the rollout's URL.

    The first call sends the prompt (with ``system`` first, if given); after each answer
    but the last, the environment speaks: ``reply`` (a fixed user message, or a function
    of the answer: a tool result, a checker's verdict). The rollout's reward is
    ``score(answers)`` over the model's answers, in order; the last response's id is the
    witness, so the gate trains exactly the chain that was scored. The environment's
    turns are in the captured row (loss mask 0: TRL's ``env_mask``); the model's answers
    are what it learns from. ``extra_body`` goes into every request (vLLM's own fields);
    ``on_response(episode, response)`` sees every response (logging, tests).
    """
    if turns < 1:
        raise ValueError(f"turns must be at least 1, not {turns}")

    async def play(client: openai.AsyncOpenAI, episode: Episode) -> Scored:
        messages = prompt_messages(episode.prompt)
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        answers: list[str] = []
        response_id = ""
        for turn in range(turns):
            if turn:
                said = reply if isinstance(reply, str) else reply(answers[-1])
                messages.append({"role": "user", "content": said})
            response = await client.chat.completions.create(
                model=episode.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=temperature,
                extra_body=dict(extra_body or {}),
            )
            if on_response is not None:
                on_response(episode, response)
            answer = response.choices[0].message.content or ""
            answers.append(answer)
            response_id = response.id
            messages.append({"role": "assistant", "content": answer})
        return Scored(reward=float(score(answers)), response_id=response_id)

    return play
