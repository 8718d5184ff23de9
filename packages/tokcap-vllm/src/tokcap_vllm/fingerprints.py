"""Message and output fingerprints: how the gate recognises a harness's echoed history, and
the content witness a scorer may send at close (`output_fingerprint`).

Messages are normalised first (content parts joined, tool-call arguments re-serialised
canonically, ids dropped) so a harness that re-encodes JSON still matches. A message with
image parts keeps its parts in order instead: text parts as they are, each image as
``{"type": "image", "sha256": <hex of its bytes>}`` (what the chat template renders as
the model's image placeholder, and what the fingerprints compare), so a changed image
changes the message. Images travel only as base64 data URLs; the gate refuses, typed,
what it cannot bind to bytes it holds (`image_digest`). `image_blind_fingerprints` are the
same fingerprints with the images' bytes unnamed, or with the images left out: what tells a
history whose only change is an image from any other. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from .errors import BadRequest, TooLarge

__all__ = [
    "MAX_IMAGE_BYTES",
    "ImageBlind",
    "content_chars",
    "image_blind_fingerprints",
    "image_bytes",
    "image_digest",
    "image_digests",
    "message_fingerprints",
    "normalize_message",
    "output_fingerprint",
]

MAX_IMAGE_BYTES: Final = 20 * 1024 * 1024
"""The largest image (decoded data-URL payload) a captured request may carry."""
_IMAGE_PARTS: Final = ("image_url", "input_image")  # chat's, and the Responses API's
_DATA_URL: Final = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,", re.ASCII)


def image_digest(part: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of the image bytes an ``image_url`` part (or a Responses
    ``input_image`` part) carries as a data URL (`image_bytes`)."""
    return hashlib.sha256(image_bytes(part)).hexdigest()


def image_bytes(part: Mapping[str, Any]) -> bytes:
    """The image bytes an ``image_url`` part (or a Responses ``input_image`` part) carries
    as a data URL.

    Refused, typed: a part with a client ``uuid`` (400 ``media_uuid_refused``: vLLM would
    key its cache on it with no check on content, and a UUID without bytes names content
    the gate never saw); a remote URL (400 ``remote_media_refused``: the gate fetches for a
    harness only from the hosts an operator allowed, and then hands this a data URL,
    `tokcap_vllm.gate._remote_media`); any other URL, a data URL that is not a base64
    image, does not decode or holds no bytes (400 ``bad_data_url``); an image over
    `MAX_IMAGE_BYTES` (413 ``media_too_large``)."""
    if part.get("uuid") is not None:
        raise BadRequest(
            "media_uuid_refused",
            "images named by a client uuid cannot be captured (send the bytes, no uuid)",
        )
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if not isinstance(url, str):
        raise BadRequest("bad_data_url", "an image_url part needs a url (a base64 data URL)")
    if url[:8].lower().startswith(("http://", "https://")):
        raise BadRequest(
            "remote_media_refused",
            "remote image URLs are fetched only from the hosts the gate allows "
            "(--tokcap-allow-remote-media): send the image as a data URL",
        )
    head = _DATA_URL.match(url[:160])
    if head is None:
        raise BadRequest("bad_data_url", "an image must be a data:image/...;base64, URL")
    payload = url[head.end() :]
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4:
        raise TooLarge("media_too_large", f"an image may have at most {MAX_IMAGE_BYTES} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest("bad_data_url", f"the image's base64 does not decode: {e}") from None
    if not data:
        raise BadRequest("bad_data_url", "an image data URL holds no bytes")
    if len(data) > MAX_IMAGE_BYTES:
        raise TooLarge("media_too_large", f"an image may have at most {MAX_IMAGE_BYTES} bytes")
    return data


def image_digests(messages: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The byte digests of the images in normalised ``messages``, in prompt order."""
    return tuple(
        part["sha256"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image"
    )


def _content_of(content: object) -> str | list[dict[str, str]]:
    """A message's content, normalised: text (parts joined), or parts when it has images."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, str]] = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append({"type": "text", "text": part["text"]})
            elif isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, Mapping) and part.get("type") in _IMAGE_PARTS:
                parts.append({"type": "image", "sha256": image_digest(part)})
            else:
                raise BadRequest("unsupported_content", "only text and image parts can be captured")
        if any(p["type"] == "image" for p in parts):
            return parts
        return "\n".join(p["text"] for p in parts)
    raise BadRequest("bad_body", "message content must be a string, a list of parts or null")


def content_chars(content: str | list[dict[str, str]]) -> int:
    """How many characters of text a normalised content holds (images count none)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


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
    out: dict[str, Any] = {
        "role": message["role"],
        "content": _content_of(message.get("content")),
    }
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


class ImageBlind(NamedTuple):
    """Fingerprints of a conversation that do not see its images' bytes."""

    places: str
    """The rolling fingerprint with each image's digest unnamed (its place kept)."""
    text: str
    """The rolling fingerprint with the images left out (a message of images alone too)."""
    images: int
    """How many images the conversation holds."""


def image_blind_fingerprints(messages: Iterable[Mapping[str, Any]]) -> list[ImageBlind]:
    """Element ``i`` covers normalised ``messages[: i + 1]`` as `message_fingerprints` does,
    blind to the images (`ImageBlind`)."""
    out: list[ImageBlind] = []
    places = text = b"tokcap/conversation/image-blind/v1"
    images = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            n = sum(1 for p in content if p.get("type") == "image")
            images += n
            unnamed = [{"type": "image"} if p.get("type") == "image" else p for p in content]
            places = hashlib.sha256(places + _canonical({**message, "content": unnamed})).digest()
            words = [p["text"] for p in content if p.get("type") == "text"]
            if words or message.get("role") != "user":  # a user turn of images alone goes
                joined = {**message, "content": "\n".join(words)}
                text = hashlib.sha256(text + _canonical(joined)).digest()
        else:
            places = hashlib.sha256(places + _canonical(message)).digest()
            text = hashlib.sha256(text + _canonical(message)).digest()
        out.append(ImageBlind(places.hex(), text.hex(), images))
    return out


def output_fingerprint(
    content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """Fingerprint of one returned assistant message (content and tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return hashlib.sha256(b"tokcap/output/v1" + _canonical(normalize_message(message))).hexdigest()
