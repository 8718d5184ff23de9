"""Message and output fingerprints: how the gate recognises a harness's echoed history, and
the content witness a scorer may send at close (`output_fingerprint`).

Messages are normalised first (content parts joined, tool-call arguments re-serialised
canonically, ids dropped) so a harness that re-encodes JSON still matches. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import BadRequest

__all__ = ["message_fingerprints", "normalize_message", "output_fingerprint"]


def _text_of(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise BadRequest("unsupported_content", "only text content parts can be captured")
        return "\n".join(parts)
    raise BadRequest("bad_body", "message content must be a string, a list of parts or null")


def _arguments(value: object) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
        except RecursionError:
            raise _too_deep("tool-call arguments") from None
    return value


def _too_deep(what: str) -> BadRequest:
    # Python's JSON codecs recurse: nesting near the interpreter's recursion limit (~1,000)
    # raises RecursionError, which must answer as the caller's mistake, never a 500.
    return BadRequest("bad_json", f"{what} nested too deeply")


def normalize_message(message: object) -> dict[str, Any]:
    """The fields of a chat message that identify it (and feed the template), canonically."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise BadRequest("bad_body", "every message must be an object with a string role")
    out: dict[str, Any] = {"role": message["role"], "content": _text_of(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise BadRequest("bad_body", "tool_calls must be a list")
        norm = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping):
                raise BadRequest("bad_body", "a tool call needs a function object")
            norm.append(
                {
                    "type": "function",
                    "function": {
                        "name": fn.get("name"),
                        "arguments": _arguments(fn.get("arguments")),
                    },
                }
            )
        out["tool_calls"] = norm
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _canonical(obj: object) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except RecursionError:
        raise _too_deep("a message") from None


def message_fingerprints(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """Rolling fingerprints: element ``i`` covers ``messages[: i + 1]`` (hex SHA-256)."""
    out, prev = [], b"tokcap/conversation/v1"
    for message in messages:
        digest = hashlib.sha256(prev + _canonical(message)).digest()
        out.append(digest.hex())
        prev = digest
    return out


def output_fingerprint(
    content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """Fingerprint of one returned assistant message (content and tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return hashlib.sha256(b"tokcap/output/v1" + _canonical(normalize_message(message))).hexdigest()
