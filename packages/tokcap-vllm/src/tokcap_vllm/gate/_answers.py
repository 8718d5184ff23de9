"""What a Messages or Responses answer returned, read as the chat turn it becomes next time.

vLLM turns Anthropic Messages and OpenAI Responses requests into chat messages before
templating, so the gate plans them as chat, and a call's returned turn must be read the way
it comes back: as the assistant chat message the harness's next request converts it into.
`MessagesAnswer` reads an Anthropic answer (one JSON body, or its ``message_start`` …
``message_stop`` event stream); `ResponsesAnswer` reads a Responses answer (one JSON body,
or its events up to ``response.completed``, which carries the whole response) and keeps its
output items, which a later ``previous_response_id`` names as history.

What the conversions do, and so what is read here: Anthropic ``text`` blocks that are not
empty become the content (joined by newlines once normalised, as `normalize_message` joins
parts), ``tool_use`` blocks become tool calls (``input`` as JSON arguments; ``{}`` when
empty), ``thinking`` becomes ``reasoning`` (not part of a turn's identity); Responses
``message`` items give their first text part, ``function_call`` items tool calls (only
plain function tools are captured), reasoning items are left out likewise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ApiAnswer", "MessagesAnswer", "ResponsesAnswer", "answer_reader"]


class ApiAnswer:
    """Common shape of the readers: the response id, whether the stream ended, the turn."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.done = False
        """The stream's terminal event went by (a normal end for the harness's client)."""

    def whole(self, body: Mapping[str, Any]) -> None:
        """Read a complete (non-streaming) answer."""
        raise NotImplementedError

    def event(self, data: Mapping[str, Any]) -> None:
        """Read one event of a streamed answer."""
        raise NotImplementedError

    def content(self) -> str:
        """The returned turn's content, as its chat message will hold it."""
        raise NotImplementedError

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The returned turn's tool calls, in chat form (None: none)."""
        raise NotImplementedError


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _call(name: object, arguments: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": _text(name), "arguments": arguments}}


class MessagesAnswer(ApiAnswer):
    """An Anthropic Messages answer: its content blocks, by index."""

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[int, dict[str, Any]] = {}

    def whole(self, body: Mapping[str, Any]) -> None:
        self.response_id = self.response_id or _str_or_none(body.get("id"))
        for i, block in enumerate(_list(body.get("content"))):
            if isinstance(block, Mapping):
                self._start(i, block)
                if block.get("type") == "tool_use":
                    self._blocks[i]["arguments"] = json.dumps(block.get("input") or {})

    def event(self, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        index = data.get("index")
        if kind == "message_start" and isinstance(data.get("message"), Mapping):
            self.response_id = self.response_id or _str_or_none(data["message"].get("id"))
        elif kind == "content_block_start" and isinstance(index, int):
            block = data.get("content_block")
            if isinstance(block, Mapping):
                self._start(index, block)
        elif kind == "content_block_delta" and isinstance(index, int) and index in self._blocks:
            delta = data.get("delta")
            if not isinstance(delta, Mapping):
                return
            slot = self._blocks[index]
            if delta.get("type") == "text_delta" and slot["type"] == "text":
                slot["text"] += _text(delta.get("text"))
            elif delta.get("type") == "input_json_delta" and slot["type"] == "tool_use":
                slot["arguments"] += _text(delta.get("partial_json"))
        elif kind == "message_stop":
            self.done = True

    def _start(self, index: int, block: Mapping[str, Any]) -> None:
        if block.get("type") == "text":
            self._blocks[index] = {"type": "text", "text": _text(block.get("text"))}
        elif block.get("type") == "tool_use":
            self._blocks[index] = {"type": "tool_use", "name": block.get("name"), "arguments": ""}

    def content(self) -> str:
        blocks = [self._blocks[i] for i in sorted(self._blocks)]
        return "\n".join(b["text"] for b in blocks if b["type"] == "text" and b["text"])

    def tool_calls(self) -> list[dict[str, Any]] | None:
        calls = [
            _call(b["name"], b["arguments"] or "{}")
            for i in sorted(self._blocks)
            if (b := self._blocks[i])["type"] == "tool_use"
        ]
        return calls or None


class ResponsesAnswer(ApiAnswer):
    """An OpenAI Responses answer: its output items (kept for ``previous_response_id``)."""

    def __init__(self) -> None:
        super().__init__()
        self.output: list[dict[str, Any]] | None = None
        """The answer's output items as the harness received them (None: not seen yet)."""

    def whole(self, body: Mapping[str, Any]) -> None:
        self.response_id = self.response_id or _str_or_none(body.get("id"))
        items = _list(body.get("output"))
        self.output = [dict(item) for item in items if isinstance(item, Mapping)]

    def event(self, data: Mapping[str, Any]) -> None:
        response = data.get("response")
        if not isinstance(response, Mapping):
            return
        if data.get("type") == "response.created":
            self.response_id = self.response_id or _str_or_none(response.get("id"))
        elif data.get("type") == "response.completed":
            self.whole(response)
            self.done = True

    def content(self) -> str:
        texts = []
        for item in self.output or ():
            parts = _list(item.get("content"))
            if item.get("type") == "message" and parts and isinstance(parts[0], Mapping):
                texts.append(_text(parts[0].get("text")))
        return "".join(texts)

    def tool_calls(self) -> list[dict[str, Any]] | None:
        calls = []
        for item in self.output or ():
            if item.get("type") != "function_call":
                continue
            calls.append(_call(item.get("name"), _text(item.get("arguments"))))
        return calls or None


def answer_reader(kind: str) -> ApiAnswer | None:
    """The reader of ``kind``'s answers (None: a chat or completion answer)."""
    if kind == "messages":
        return MessagesAnswer()
    if kind == "responses":
        return ResponsesAnswer()
    return None


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None
