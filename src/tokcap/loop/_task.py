"""``tokcap train``'s tasks and harness: a black box that asks for digits over the OpenAI API.

Each rollout is a short chat: the user asks for a long number, the model answers, then the
environment speaks and the model answers again (``turns`` calls, each a real chat call
through the gate, each one extending the one before). Two tasks:

- ``agent`` (the default, two calls): after each answer the environment runs a digit
  checker on it and hands back its result as a tool response (``<tool_response>`` JSON in a
  user turn, exactly how Qwen's ChatML renders a ``tool`` message), and the model goes on.
  The model's own turns are free text: nothing is forced by guided decoding, so every
  trained token was sampled from the policy's unmasked distribution and its captured
  logprob is the behaviour policy's (no token needs masking out of the loss or the
  importance weights).
- ``digits``: the user just asks for more digits between calls.
- ``long-tail``: the ``agent`` task with a long-tailed shape, as real agent work has
  (`long_tail_shape`, seeded per rollout): four rollouts in five make 1 or 2 calls of
  ``max_tokens``, the fifth 6 to 10 calls of four times ``max_tokens``. A lock-step loop
  waits for that fifth with a nearly empty engine batch; this is where an asynchronous
  loop earns its keep (``bench/bench_async.py --task long-tail``).

The scorer sees text only: the reward is the share of the answers' non-space characters
that are digits, in [0, 1]. A random tiny model writes almost no digits (about 0.2 %); a
policy-gradient loop on these rewards teaches it to write mostly digits within a few dozen
steps.

The scorer's witnesses follow the demo: per rollout slot, the scored response id, the
scored content, a declared terminal, or none (the gate's deepest-chain choice).

With a vision-language model (``--model-family idefics3``) every rollout's first user
message carries its group's image (`group_image`, a small PNG sent as a base64 data URL),
so the group's rollouts share one staged blob of processed tensors.

The harness speaks one of three APIs (``--harness-api``): ``chat`` (chat completions, the
default), ``responses`` (the ``openai`` client's Responses API, each call after the first
naming the one before by ``previous_response_id`` and sending only the environment's new
turn) or ``messages`` (the ``anthropic`` SDK at the rollout's base URL, the whole history
each call). The gate plans all three as the same chat turns, so the rows are alike.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

__all__ = [
    "HARNESS_APIS",
    "TASKS",
    "WITNESSES",
    "DigitsEpisode",
    "HarnessApi",
    "Task",
    "Witness",
    "digit_share",
    "group_image",
    "long_tail_shape",
    "play_digits",
    "tool_response",
]

Task = Literal["agent", "digits", "long-tail"]
TASKS: tuple[Task, ...] = ("agent", "digits", "long-tail")

LONG_TAIL_SHARE = 0.2
"""The share of ``long-tail`` rollouts in the tail."""
LONG_TAIL_CALLS = (6, 10)
"""A tail rollout's calls (inclusive range); the others make 1 or 2."""
LONG_TAIL_TOKENS = 4
"""A tail rollout's ``max_tokens``, in multiples of the run's."""

HarnessApi = Literal["chat", "responses", "messages"]
HARNESS_APIS: tuple[HarnessApi, ...] = ("chat", "responses", "messages")
"""The APIs the harness can speak (the first is the default)."""

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


def tool_response(answer: str) -> str:
    """The digit checker's result on ``answer``, as the environment's tool-response turn."""
    chars = [c for c in answer if not c.isspace()]
    result = {
        "tool": "count_digits",
        "digits": sum(c.isdigit() for c in chars),
        "chars": len(chars),
    }
    return f"<tool_response>\n{json.dumps(result)}\n</tool_response>"


def group_prompt(seed: int, group: int) -> str:
    """The user's first message for every rollout of a group."""
    rng = random.Random(f"{seed}/{group}")
    return f"Write a long number that starts with {rng.randint(10, 99)}."


def group_image(seed: int, group: int, size: int = 48) -> bytes:
    """The PNG (``size`` x ``size`` RGB, colours from ``seed`` and ``group``) every rollout
    of a group sees; made with the standard library (zlib), no image package."""
    rng = random.Random(f"image/{seed}/{group}")
    base = [rng.randrange(256) for _ in range(3)]
    rows = b"".join(
        b"\x00"
        + bytes((base[c] + (x * 7, y * 11, x * y)[c]) % 256 for x in range(size) for c in range(3))
        for y in range(size)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"".join(
        [b"\x89PNG\r\n\x1a\n", chunk(b"IHDR", header), chunk(b"IDAT", zlib.compress(rows)),
         chunk(b"IEND", b"")]
    )  # fmt: skip


def long_tail_shape(seed: int, max_tokens: int) -> tuple[int, int]:
    """``(calls, max_tokens)`` of the ``long-tail`` rollout seeded ``seed``: with
    probability `LONG_TAIL_SHARE` 6 to 10 calls of ``LONG_TAIL_TOKENS * max_tokens``, else
    1 or 2 calls of ``max_tokens`` (each choice uniform). The same seed, the same shape."""
    rng = random.Random(f"long-tail/{seed}")
    if rng.random() < LONG_TAIL_SHARE:
        return rng.randint(*LONG_TAIL_CALLS), LONG_TAIL_TOKENS * max_tokens
    return rng.randint(1, 2), max_tokens


@dataclass(slots=True)
class DigitsEpisode:
    """One rollout as the harness saw it."""

    rollout_id: str
    group_id: str
    witness: Witness
    prompt: str
    image: bytes | None = None
    """A PNG the first user message carries (a vision-language model's task)."""
    response_ids: list[str] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)
    reward: float = 0.0

    @property
    def scored(self) -> Witness:
        """The witness the scorer gives: ``content`` falls back to ``response_id`` when the
        scored answer repeats an earlier answer of the rollout (a content fingerprint shared
        by two calls names neither, and the gate poisons the rollout as ambiguous: seen once
        a policy writes the same digits twice)."""
        if (
            self.witness == "content"
            and self.contents[-1:]
            and self.contents[-1] in self.contents[:-1]
        ):
            return "response_id"
        return self.witness


async def play_digits(
    client: openai.AsyncOpenAI,
    model: str,
    episode: DigitsEpisode,
    *,
    turns: int,
    max_tokens: int,
    seed: int,
    task: Task = "digits",
    api: HarnessApi = "chat",
) -> DigitsEpisode:
    """Play ``turns`` calls (sampled at temperature 1) of ``task`` over ``api``; fill the
    answers and the reward. ``long-tail`` draws its calls and ``max_tokens`` from ``seed``
    instead (`long_tail_shape`; ``turns`` is not used)."""
    if task == "long-tail":
        turns, max_tokens = long_tail_shape(seed, max_tokens)
    first: str | list[dict[str, Any]] = episode.prompt
    if episode.image is not None:
        url = f"data:image/png;base64,{base64.b64encode(episode.image).decode()}"
        first = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": episode.prompt},
        ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    call = _CALLERS[api]
    for turn in range(turns):
        if turn:
            said = MORE if task == "digits" else tool_response(episode.contents[-1])
            messages.append({"role": "user", "content": said})
        ask = _Ask(
            model=model,
            messages=messages,
            earlier=episode.response_ids,
            max_tokens=max_tokens,
            seed=seed * 100 + turn,
        )
        response_id, content = await call(client, ask)
        episode.response_ids.append(response_id)
        episode.contents.append(content)
        messages.append({"role": "assistant", "content": content})
    episode.reward = digit_share("".join(episode.contents))
    return episode


@dataclass(frozen=True, slots=True, kw_only=True)
class _Ask:
    """One call of a rollout, whichever API makes it: the conversation so far (chat form),
    the response ids of the calls before it, its token budget and its seed."""

    model: str
    messages: list[dict[str, Any]]
    earlier: list[str]
    max_tokens: int
    seed: int


async def _chat(client: openai.AsyncOpenAI, ask: _Ask) -> tuple[str, str]:
    response = await client.chat.completions.create(
        model=ask.model,
        messages=[{"role": "system", "content": SYSTEM}, *ask.messages],  # type: ignore[list-item]
        max_tokens=ask.max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=ask.seed,
    )
    return response.id, response.choices[0].message.content or ""


async def _responses(client: openai.AsyncOpenAI, ask: _Ask) -> tuple[str, str]:
    """The newest user turn alone, chained to the call before by ``previous_response_id``."""
    chained = {"previous_response_id": ask.earlier[-1]} if ask.earlier else {}
    response = await client.responses.create(  # type: ignore[call-overload]
        model=ask.model,
        input=ask.messages[-1:],
        instructions=SYSTEM,
        max_output_tokens=ask.max_tokens,
        temperature=1.0,
        top_p=1.0,
        extra_body={"seed": ask.seed},
        **chained,
    )
    return str(response.id), str(response.output_text)


async def _messages(client: openai.AsyncOpenAI, ask: _Ask) -> tuple[str, str]:
    """The whole history through the ``anthropic`` SDK (a Messages request has no seed)."""
    import anthropic

    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    async with anthropic.AsyncAnthropic(
        base_url=base, api_key=client.api_key, max_retries=0
    ) as sdk:
        answer = await sdk.messages.create(
            model=ask.model,
            system=SYSTEM,
            messages=ask.messages,  # type: ignore[arg-type]
            max_tokens=ask.max_tokens,
            # this SDK takes no sampling fields of its own: vLLM reads them from the body
            extra_body={"temperature": 1.0, "top_p": 1.0},
        )
    return str(answer.id), "".join(b.text for b in answer.content if b.type == "text")


_CALLERS = {"chat": _chat, "responses": _responses, "messages": _messages}
