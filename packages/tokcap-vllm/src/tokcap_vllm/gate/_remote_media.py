"""Remote images, fetched by the gate itself from the hosts an operator allowed.

By default the gate fetches nothing on a harness's behalf: a remote image URL is refused
(400 ``remote_media_refused``, `tokcap_vllm.fingerprints.image_digest`), and vLLM never
sees it. `GateConfig.allow_remote_media` names the hosts (``host`` for any port, or
``host:port``) whose ``http``/``https`` image URLs the gate fetches, before anything is
planned: each image once, bounded by `MAX_IMAGE_BYTES` and
`GateConfig.remote_media_timeout_s`, and written into the request's body as a data URL of
the bytes it received. What is hashed is then what vLLM processes: vLLM never fetches,
and a server that changes what it serves between two fetches cannot split them.

The image parts read: chat's ``image_url`` (and a Responses ``input_image``) at any depth
of the body (a tool message's or a ``function_call_output``'s content included), and an
Anthropic ``image`` block whose ``source`` is ``{"type": "url", ...}`` (a ``tool_result``'s
included). Refused, typed: a URL on a host not allowed (``remote_media_refused``, left for
`image_digest` to refuse); a fetch that fails, times out, is redirected (never followed: a
redirect may lead to a host not allowed) or answers no ``image/*`` content type (400
``remote_media_failed``); more than `MAX_IMAGE_BYTES` (413 ``media_too_large``).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import httpx

from ..errors import BadRequest, TooLarge
from ..fingerprints import MAX_IMAGE_BYTES

__all__ = ["fetch_remote_media", "host_allowed"]

_MIME: Final = re.compile(r"image/[A-Za-z0-9.+-]+", re.ASCII)


def host_allowed(url: str, allowed: Sequence[str]) -> bool:
    """Whether ``url`` is an ``http``/``https`` URL on a host of ``allowed`` (``host``, any
    port; or ``host:port``), compared case-insensitively."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return False
    host = parts.hostname.lower()
    port = port if port is not None else (443 if parts.scheme.lower() == "https" else 80)
    return any(entry.lower() in (host, f"{host}:{port}") for entry in allowed)


async def fetch_remote_media(body: bytes, allowed: Sequence[str], *, timeout_s: float) -> bytes:
    """``body`` with every remote image URL on an allowed host replaced by a data URL of the
    bytes fetched from it (``body`` itself when it names none; typed errors: module doc)."""
    if not allowed or b"http" not in body.lower():
        return body
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return body  # the request's own decoding answers it, typed
    slots = [slot for slot in _image_slots(raw) if host_allowed(slot.url, allowed)]
    if not slots:
        return body
    fetched: dict[str, str] = {}
    async with httpx.AsyncClient(follow_redirects=False, timeout=timeout_s) as client:
        for slot in slots:
            if slot.url not in fetched:
                fetched[slot.url] = await _fetch(client, slot.url)
    for slot in slots:
        slot.replace(fetched[slot.url])
    return json.dumps(raw).encode()


class _Slot:
    """Where one remote image URL sits in the body, and how to put a data URL there."""

    def __init__(self, holder: dict[str, Any], key: str, url: str, anthropic: bool) -> None:
        self.holder, self.key, self.url, self.anthropic = holder, key, url, anthropic

    def replace(self, data_url: str) -> None:
        if self.anthropic:  # an Anthropic source: base64 data and its media type
            mime, _, data = data_url.removeprefix("data:").partition(";base64,")
            self.holder[self.key] = {"type": "base64", "media_type": mime, "data": data}
        else:
            self.holder[self.key] = data_url


def _image_slots(raw: Any) -> Iterator[_Slot]:
    """Every remote image URL of a decoded body, found without recursion (bodies nest)."""
    stack = [raw]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind in ("image_url", "input_image"):
            value = node.get("image_url")
            if isinstance(value, dict) and isinstance(value.get("url"), str):
                yield _Slot(value, "url", value["url"], anthropic=False)
            elif isinstance(value, str):
                yield _Slot(node, "image_url", value, anthropic=False)
        elif kind == "image" and isinstance(node.get("source"), dict):
            source = node["source"]
            if source.get("type") == "url" and isinstance(source.get("url"), str):
                yield _Slot(node, "source", source["url"], anthropic=True)
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))


async def _fetch(client: httpx.AsyncClient, url: str) -> str:
    """The image at ``url`` as a base64 data URL."""
    try:
        async with client.stream("GET", url) as answer:
            if answer.status_code != 200:
                raise _failed(url, f"it answered HTTP {answer.status_code}")
            mime = answer.headers.get("content-type", "").split(";")[0].strip().lower()
            if not _MIME.fullmatch(mime):
                raise _failed(url, f"it answered content type {mime[:60]!r}, not an image")
            data = bytearray()
            async for chunk in answer.aiter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise TooLarge(
                        "media_too_large", f"an image may have at most {MAX_IMAGE_BYTES} bytes"
                    )
    except httpx.HTTPError as e:
        raise _failed(url, f"{type(e).__name__}") from None
    if not data:
        raise _failed(url, "it answered no bytes")
    return f"data:{mime};base64,{base64.b64encode(bytes(data)).decode()}"


def _failed(url: str, why: str) -> BadRequest:
    return BadRequest("remote_media_failed", f"the image at {url[:120]!r} was not fetched: {why}")
