"""The demo's harness on the two other APIs agents speak: OpenAI Responses and Anthropic Messages.

The same task, tool and turn pattern as the chat harness (`tokcap.demo._harness.play_chat`:
forced tool calls on even turns, two on the first, free text between and last), over HTTP
through the gate with the official clients:

- ``responses``: the ``openai`` client's ``responses`` API; each turn after the first names
  the one before by ``previous_response_id`` and sends only what is new (one
  ``function_call_output`` item per call, or a nudge);
- ``messages``: the ``anthropic`` SDK pointed at the rollout's base URL, the whole history
  sent each turn as ``tool_use`` / ``tool_result`` blocks; forced calls ride on the gate's
  ``structured_outputs`` extension of Messages requests (``extra_body``).

Neither API returns token ids. Each `EngineCall` keeps the prompt and output lengths vLLM
reported (``usage``) and, for a Responses turn answered in text, the logprobs vLLM returned;
the demo's engine-parity check compares those with the row (`tokcap.demo._checks`). The
transcript is kept in chat form (what vLLM converts both APIs into), for the re-tokenisation
check. `run_episode` plays an episode on the API it names.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from ._harness import (
    NUDGE,
    SYSTEM,
    TOOLS,
    EngineCall,
    Episode,
    HarnessOptions,
    play_chat,
    score,
    tool_result,
)

__all__ = ["API_NOTES", "API_TOOLS", "play_messages", "play_responses", "run_episode"]

API_NOTES: dict[str, str] = {
    "chat": "openai: chat.completions (ids returned: return_token_ids)",
    "responses": "openai: responses, chained by previous_response_id (lengths: usage)",
    "messages": "anthropic: messages, tool_use / tool_result blocks (lengths: usage)",
}
"""Each API the harness speaks, with the client that speaks it and what the engine-parity
check compares its calls on."""

API_TOOLS: dict[str, list[dict[str, Any]]] = {
    "responses": [{"type": "function", **t["function"]} for t in TOOLS],
    "messages": [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ],
}
"""`TOOLS` as each API spells a function tool."""


def _forced(turn: int, turns: int) -> int:
    """How many tool calls turn ``turn`` forces (0: free text), as the chat harness does."""
    if turn == turns - 1 or turn % 2:
        return 0
    return 2 if turn == 0 else 1


def _chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turn in chat form, then one tool answer per call."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    tools = [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(c)} for c in calls]
    return [message, *tools]


async def play_responses(
    client: openai.AsyncOpenAI, model: str, episode: Episode, options: HarnessOptions, *, seed: int
) -> Episode:
    """Play ``options.turns`` Responses calls of ``episode``, chained by
    ``previous_response_id``."""
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": episode.task.prompt},
    ]
    new: str | list[dict[str, Any]] = episode.task.prompt
    previous: str | None = None
    turns = options.turns
    for turn in range(turns):
        count = _forced(turn, turns)
        response = await client.responses.create(  # type: ignore[call-overload]
            model=model,
            input=new,
            instructions=SYSTEM,
            tools=API_TOOLS["responses"],
            max_output_tokens=options.budget(count > 0),
            temperature=1.0,
            include=["message.output_text.logprobs"],
            extra_body={"seed": seed * 1000 + turn, **(options.forced(count) if count else {})},
            **({"previous_response_id": previous} if previous is not None else {}),
        )
        previous = response.id
        items = [o for o in response.output if o.type == "function_call"]
        calls = [_chat_call(o.call_id, o.name, o.arguments) for o in items]
        texts = [
            part
            for o in response.output
            if o.type == "message"
            for part in o.content
            if part.type == "output_text"
        ]
        usage = response.usage
        episode.calls.append(
            EngineCall(
                response_id=response.id,
                prompt_token_ids=[],
                token_ids=[],
                # which tokens the text came from is known only for a turn that is text alone
                logprobs=[lp.logprob for p in texts for lp in p.logprobs or ()]
                if not calls
                else [],
                content=response.output_text,
                finish_reason="tool_calls" if calls else str(response.status),
                tool_calls=len(calls),
                usage=(usage.input_tokens, usage.output_tokens) if usage else None,
            )
        )
        chat += _assistant(response.output_text, calls)
        new = [
            {"type": "function_call_output", "call_id": c["id"], "output": tool_result(c)}
            for c in calls
        ]
        if not calls:
            new = [{"role": "user", "content": NUDGE}]
            chat.append(new[0])
    if chat[-1]["role"] == "user":  # the nudge after the last turn was never sent
        chat.pop()
    return _scored(episode, chat)


async def play_messages(
    client: openai.AsyncOpenAI, model: str, episode: Episode, options: HarnessOptions, *, seed: int
) -> Episode:
    """Play ``options.turns`` Anthropic Messages calls of ``episode`` at ``client``'s rollout
    URL."""
    import anthropic

    del seed  # a Messages request has no seed
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": episode.task.prompt},
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": episode.task.prompt}]
    async with anthropic.AsyncAnthropic(
        base_url=base, api_key=client.api_key, max_retries=0, timeout=client.timeout
    ) as sdk:
        turns = options.turns
        for turn in range(turns):
            count = _forced(turn, turns)
            answer = await sdk.messages.create(
                model=model,
                system=SYSTEM,
                messages=messages,  # type: ignore[arg-type]
                tools=API_TOOLS["messages"],  # type: ignore[arg-type]
                max_tokens=options.budget(count > 0),
                # this SDK takes no sampling fields of its own: vLLM reads them from the body
                extra_body={"temperature": 1.0, **(options.forced(count) if count else {})},
            )
            uses = [b for b in answer.content if b.type == "tool_use"]
            text = "".join(b.text for b in answer.content if b.type == "text")
            calls = [_chat_call(b.id, b.name, json.dumps(b.input)) for b in uses]
            episode.calls.append(
                EngineCall(
                    response_id=answer.id,
                    prompt_token_ids=[],
                    token_ids=[],
                    logprobs=[],
                    content=text,
                    finish_reason=str(answer.stop_reason),
                    tool_calls=len(calls),
                    usage=(answer.usage.input_tokens, answer.usage.output_tokens),
                )
            )
            chat += _assistant(text, calls)
            blocks = [b.model_dump(exclude_none=True) for b in answer.content]
            messages.append({"role": "assistant", "content": blocks or text})
            if calls:
                results = [
                    {"type": "tool_result", "tool_use_id": c["id"], "content": tool_result(c)}
                    for c in calls
                ]
                messages.append({"role": "user", "content": results})
            elif turn < turns - 1:
                messages.append({"role": "user", "content": NUDGE})
                chat.append({"role": "user", "content": NUDGE})
    return _scored(episode, chat)


def _scored(episode: Episode, chat: list[dict[str, Any]]) -> Episode:
    episode.messages = chat
    episode.reward = score(episode.task, episode.final.content)
    return episode


async def run_episode(
    client: openai.AsyncOpenAI, model: str, episode: Episode, options: HarnessOptions, *, seed: int
) -> Episode:
    """Play ``episode`` on the API it names (``episode.api``): chat completions through
    `tokcap.demo._harness.play_chat`, Responses through `play_responses`, Messages through
    `play_messages`; each forces its tool calls with ``options.forced``."""
    return await _PLAYERS[episode.api](client, model, episode, options, seed=seed)


_PLAYERS = {"chat": play_chat, "responses": play_responses, "messages": play_messages}
