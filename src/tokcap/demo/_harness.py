"""The demo's agent harness: a black box that only speaks the OpenAI API, with real tool calls.

A tool-using arithmetic task. The harness offers a ``calc`` tool through ``tools=[...]``;
vLLM's own ``hermes`` tool parser turns the model's ``<tool_call>`` blocks into OpenAI
``tool_calls``, the harness echoes them in the assistant message it sends back and answers
each with a ``role: "tool"`` message, and it scores the final assistant message. The tiny
random model never calls a tool by itself, so every other turn *forces* calls through
vLLM's guided decoding (`forced_tool_calls`: an xgrammar structural tag with the tool's
JSON schema; the first turn forces two calls in parallel). The turns between are free
text (the harness nudges the model back to its tool, as agents do), and so is the last.
What matters is that each episode is several real chat calls through the gate, exactly as
an agent makes them, tool-call JSON re-serialised by the parser included.

Behaviours, one per rollout slot of a group (the rest are ``plain``):

- ``response_id``: the scorer's close witness is the scored response id;
- ``content``: the close witness is only a fingerprint of the scored content;
- ``declared``: the harness declares the terminal call (by response id) before closing;
- ``rewrite``: half-way through, the harness summarises earlier turns into one user
  message (context compaction), so the rollout's history is a forest with a break.

An episode's ``api`` says which API its harness speaks: ``chat`` (here), or the
``responses`` / ``messages`` harness of `tokcap.demo._clients` (the official ``openai``
Responses and ``anthropic`` clients, same task and turns).

Each call asks the server for ``return_token_ids``: the demo's independent check
compares every reassembled row with the ids the engine itself reported to the harness.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import openai
from openai.types.chat import ChatCompletion, ChatCompletionMessage

__all__ = [
    "APIS",
    "BEHAVIOURS",
    "TOOLS",
    "Api",
    "Behaviour",
    "EngineCall",
    "Episode",
    "HarnessOptions",
    "Task",
    "ask_with_tools",
    "engine_reported",
    "forced_tool_calls",
    "play_chat",
    "tool_calls_of",
]

Behaviour = Literal["response_id", "content", "declared", "rewrite", "plain"]
BEHAVIOURS: tuple[Behaviour, ...] = ("response_id", "content", "declared", "rewrite")
"""Behaviours of rollout slots 0..3 of every group; later slots are ``plain``."""
Api = Literal["chat", "responses", "messages"]
"""The API an episode's harness speaks."""
APIS: tuple[Api, ...] = ("chat", "responses", "messages")

SYSTEM = (
    "You solve arithmetic with the calc tool. When you know the result, answer with the number."
)
TOOLS: Final[tuple[dict[str, Any], ...]] = (
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Compute a op b for integers a and b.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "op": {"type": "string", "enum": ["+", "-", "*"]},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "op", "b"],
                "additionalProperties": False,
            },
        },
    },
)
"""The tools the harness offers on every call (OpenAI ``tools=[...]``)."""
NUDGE: Final = "Use the calc tool, then answer with the number."
"""What the harness says after a turn that called no tool."""
_NUMBER = re.compile(r"-?\d+")
_TOOL_TURN_TOKENS: Final = 232
"""Room on top of ``max_tokens`` for forced calls: one takes ~50 tokens of this tokenizer,
more when the model spells the forced text in short pieces."""
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
    tool_calls: int = 0
    """How many tool calls vLLM's parser found in the answer."""
    usage: tuple[int, int] | None = None
    """The prompt and output lengths vLLM reported, for an API that returns no ids (the ids
    lists are then empty)."""


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
    api: Api = "chat"
    images: list[bytes] = field(default_factory=list)
    """The images the harness sent the engine, in the order it first sent them."""

    @property
    def final(self) -> EngineCall:
        """The scored call (the last one)."""
        return self.calls[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class HarnessOptions:
    """How the harness plays every episode of a run, on whichever API: ``turns`` calls of
    ``max_tokens`` each (more on a turn that forces tool calls); ``force_tools`` turns a
    call count into request fields (None: `forced_tool_calls` on `TOOLS`, for a model served
    with vLLM's ``hermes`` parser); ``tools_every_turn`` and ``images`` apply to chat only
    (`play_chat`)."""

    turns: int
    max_tokens: int
    force_tools: Callable[[int], dict[str, Any]] | None = None
    tools_every_turn: bool = False
    images: bool = False

    def forced(self, count: int) -> dict[str, Any]:
        """The request fields that force ``count`` tool calls."""
        return _forcing(self.force_tools, count)

    def budget(self, forcing: bool) -> int:
        """``max_tokens`` of a call, with room for the calls when it forces them."""
        return self.max_tokens + _TOOL_TURN_TOKENS if forcing else self.max_tokens


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


def tool_result(call: Mapping[str, Any]) -> str:
    """The calc tool's reply to one OpenAI tool call (``{"function": {"arguments": ...}}``)."""
    try:
        args = json.loads(call["function"]["arguments"])
        expression = f"{int(args['a'])} {args['op']} {int(args['b'])}"
        return f"{expression} = {calc(expression):g}"
    except (KeyError, TypeError, ValueError) as e:
        return f"error: {e}"


def forced_tool_calls(tools: Sequence[Mapping[str, Any]], count: int) -> dict[str, Any]:
    """Request fields that force ``count`` tool calls through vLLM's guided decoding.

    A structural tag (xgrammar) in ``structured_outputs``: ``count`` Hermes-style
    ``<tool_call>`` blocks, newline-separated, each naming one of ``tools`` with arguments
    that follow its JSON schema, then the end of the turn. ``tool_choice="auto"`` keeps
    vLLM's ``hermes`` parser in charge of turning them into ``tool_calls``. Why not
    ``tool_choice="required"``: it does reach xgrammar on CPU, but vLLM's built-in Hermes
    tag leaves JSON whitespace unbounded and a random model fills ``max_tokens`` with it;
    here at most one whitespace character may sit between JSON tokens.
    """
    if count < 1:
        raise ValueError("count must be at least 1")
    tags = [
        {
            "type": "tag",
            "begin": '<tool_call>\n{"name": "' + t["function"]["name"] + '", "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": t["function"]["parameters"],
                "max_whitespace_cnt": 1,
            },
            "end": "}\n</tool_call>",
        }
        for t in tools
    ]
    one: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    elements: list[dict[str, Any]] = [one]
    for _ in range(count - 1):
        elements += [{"type": "const_string", "value": "\n"}, one]
    shape = one if count == 1 else {"type": "sequence", "elements": elements}
    tag = json.dumps({"type": "structural_tag", "format": shape})
    return {"structured_outputs": {"structural_tag": tag}}


def score(task: Task, content: str) -> float:
    """1.0 for the right answer, plus a small brevity bonus so wrong answers still rank.

    Deterministic in the content: the last integer in the message is the answer given.
    """
    numbers = _NUMBER.findall(content)
    correct = 1.0 if numbers and int(numbers[-1]) == task.answer else 0.0
    return correct + 0.1 * max(0.0, 1.0 - len(content) / 200.0)


async def play_chat(
    client: openai.AsyncOpenAI,
    model: str,
    episode: Episode,
    options: HarnessOptions,
    *,
    seed: int,
) -> Episode:
    """Play ``options.turns`` chat calls of ``episode``; fills its calls, transcript and reward.

    Even turns but the last force tool calls (two on the first turn, in parallel) through
    ``options.forced``; with ``tools_every_turn`` every turn but the last does (no user
    nudges: with tools offered, Mistral's tokenizers re-render the history at every new user
    turn, which starts a new root); the assistant message goes back as vLLM returned it
    (``content`` and ``tool_calls``), followed by one ``role: "tool"`` answer per call, or by
    a user nudge after free text.
    With ``images`` (a model that takes them), the first user message carries a picture of
    the task and the first tool answer a picture of its result (`tokcap.demo._images`);
    ``episode.images`` lists them.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _user_content(episode, options.images)},
    ]
    turns = options.turns
    for turn in range(turns):
        if episode.behaviour == "rewrite" and turn == max(1, turns // 2):
            messages = _compact(messages, episode.task)
        last = turn == turns - 1
        forced = not last and (options.tools_every_turn or turn % 2 == 0)
        _note_images(episode, messages)
        response = await ask_with_tools(
            client,
            model,
            messages,
            max_tokens=options.budget(forced),
            seed=seed * 1000 + turn,
            force=(2 if turn == 0 else 1) if forced else 0,
            force_tools=options.force_tools,
        )
        choice = response.choices[0]
        message = choice.message
        calls = tool_calls_of(message)
        prompt_token_ids, token_ids, logprobs = engine_reported(response)
        episode.calls.append(
            EngineCall(
                response_id=response.id,
                prompt_token_ids=prompt_token_ids,
                token_ids=token_ids,
                logprobs=logprobs,
                content=message.content or "",
                finish_reason=choice.finish_reason or "",
                tool_calls=len(calls),
            )
        )
        assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        messages += [
            {
                "role": "tool",
                "tool_call_id": c["id"],
                "content": _tool_content(c, calls[0], episode, options.images),
            }
            for c in calls
        ]
        if not calls and not last:
            messages.append({"role": "user", "content": NUDGE})
    episode.messages = messages
    episode.reward = score(episode.task, episode.final.content)
    return episode


async def ask_with_tools(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    seed: int,
    force: int = 0,
    force_tools: Callable[[int], dict[str, Any]] | None = None,
) -> ChatCompletion:
    """One chat call offering `TOOLS` (``tool_choice="auto"``), sampled at temperature 1,
    asking for logprobs and the engine's ids (``return_token_ids``); it forces ``force``
    tool calls (0: the model chooses) through ``force_tools`` (``count`` → request fields;
    default `forced_tool_calls` on `TOOLS`)."""
    forced = _forcing(force_tools, force) if force else {}
    response: ChatCompletion = await client.chat.completions.create(  # type: ignore[call-overload]
        model=model,
        messages=messages,
        tools=list(TOOLS),
        tool_choice="auto",
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        logprobs=True,
        extra_body={"return_token_ids": True, **forced},
    )
    return response


def _forcing(force_tools: Callable[[int], dict[str, Any]] | None, count: int) -> dict[str, Any]:
    return force_tools(count) if force_tools else forced_tool_calls(TOOLS, count)


def tool_calls_of(message: ChatCompletionMessage) -> list[dict[str, Any]]:
    """A chat answer's function calls, as the next request's assistant message echoes them."""
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": c.function.arguments},
        }
        for c in message.tool_calls or ()
        if c.type == "function"
    ]


def engine_reported(response: ChatCompletion) -> tuple[list[int], list[int], list[float]]:
    """The prompt ids, generated ids and logprobs vLLM returned with a chat answer (empty
    where it returned none)."""
    choice = response.choices[0]
    return (
        list(getattr(response, "prompt_token_ids", None) or []),
        list(getattr(choice, "token_ids", None) or []),
        [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []],
    )


def _user_content(episode: Episode, images: bool) -> str | list[dict[str, Any]]:
    """The first user message: the task, after a picture of it when ``images``."""
    if not images:
        return episode.task.prompt
    from ._images import image_part, picture

    image = image_part(picture(f"task/{episode.task.prompt}"))
    return [image, {"type": "text", "text": episode.task.prompt}]


def _tool_content(
    call: Mapping[str, Any], first: Mapping[str, Any], episode: Episode, images: bool
) -> str | list[dict[str, Any]]:
    """A tool answer: the result, and a picture of it in the episode's first tool answer
    (``call`` is ``first``, the first call of the first turn) when ``images``."""
    result = tool_result(call)
    if not images or len(episode.calls) != 1 or call is not first:
        return result
    from ._images import image_part, picture

    image = image_part(picture(f"result/{episode.rollout_id}/{result}"))
    return [{"type": "text", "text": result}, image]


def _note_images(episode: Episode, messages: Sequence[Mapping[str, Any]]) -> None:
    """Add the images ``messages`` carry that ``episode.images`` does not hold yet."""
    import base64

    for message in messages:
        content = message["content"]
        for part in content if isinstance(content, list) else ():
            if part.get("type") == "image_url":
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                if data not in episode.images:
                    episode.images.append(data)


def _text(content: str | Sequence[Mapping[str, Any]]) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def _compact(messages: list[dict[str, Any]], task: Task) -> list[dict[str, Any]]:
    """Context compaction: everything after the system prompt becomes one summary message."""
    results = [_text(m["content"]) for m in messages if m["role"] == "tool"]
    summary = f"{task.prompt} (Summary: the calculator said {'; '.join(results) or 'nothing'}.)"
    return [messages[0], {"role": "user", "content": summary}]
