"""The ASGI vocabulary the gate speaks: scope, messages, and the two helpers every route needs.

One definition of the ASGI callable types (the middleware, the control plane and the
captured path share them), one body reader with a size bound, one JSON answer writer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, TypeAlias

from ..errors import BadRequest, TooLarge

__all__ = ["App", "Message", "Receive", "Scope", "Send", "header_values", "read_body", "send_body"]

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
App: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]


def header_values(scope: Scope, name: bytes) -> list[str]:
    """Every value of header ``name`` (lower-case bytes), in order, decoded as latin-1."""
    return [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == name]


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; `TooLarge` (413 ``body_too_large``) if it exceeds ``limit``,
    `BadRequest` if the client leaves."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("client_disconnected", "the client went away while sending")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge("body_too_large", f"request body over {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"application/json",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Answer with one complete body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
