"""Remote images fetched by the gate (`tokcap_vllm.gate._remote_media`), no engine: a real
HTTP server on 127.0.0.1 (the only network here) serves the images, the gate's real
``httpx`` client fetches them."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import pytest

from tests.vllm._vlm import ImageRoutes, Routes, serve_images
from tokcap_core import ConfigError
from tokcap_vllm import GateConfig
from tokcap_vllm.errors import BadRequest, TooLarge
from tokcap_vllm.fingerprints import MAX_IMAGE_BYTES, image_digest
from tokcap_vllm.gate._remote_media import fetch_remote_media, host_allowed

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(200))


class _Images(ImageRoutes):
    routes: ClassVar[Routes] = {
        "/a.png": (200, "image/png", IMAGE),
        "/page": (200, "text/html", b"<html></html>"),
        "/empty.png": (200, "image/png", b""),
        "/huge.png": (200, "image/png", b"\0" * (MAX_IMAGE_BYTES + 1)),
    }
    release = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        if self.path == "/stalls.png":
            self.release.wait(60)
            return
        super().do_GET()


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    with serve_images(_Images) as served:
        yield served
        _Images.release.set()


def _chat(url: str) -> bytes:
    part = {"type": "image_url", "image_url": {"url": url}}
    return json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()


def _fetch(body: bytes, allowed: tuple[str, ...], timeout_s: float = 30.0) -> Any:
    async def run() -> bytes:
        return await fetch_remote_media(body, allowed, timeout_s=timeout_s)

    return json.loads(anyio.run(run))


def test_an_allowed_hosts_image_becomes_a_data_url_of_the_bytes_it_served(host: str) -> None:
    body = _fetch(_chat(f"http://{host}/a.png"), (host,))
    part = body["messages"][0]["content"][0]
    assert part["image_url"]["url"].startswith("data:image/png;base64,")
    assert image_digest(part) == hashlib.sha256(IMAGE).hexdigest()


def test_images_in_tool_results_of_every_api_are_fetched(host: str) -> None:
    url = f"http://{host}/a.png"
    responses = {
        "input": [
            {
                "type": "function_call_output",
                "call_id": "t1",
                "output": [{"type": "input_image", "image_url": url, "detail": "auto"}],
            }
        ]
    }
    block = {"type": "image", "source": {"type": "url", "url": url}}
    messages = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}],
            }
        ]
    }
    fetched = _fetch(json.dumps(responses).encode(), (host,))
    part = fetched["input"][0]["output"][0]
    assert image_digest(part) == hashlib.sha256(IMAGE).hexdigest()
    fetched = _fetch(json.dumps(messages).encode(), (host.split(":")[0],))  # any port
    source = fetched["messages"][0]["content"][0]["content"][0]["source"]
    assert source["type"] == "base64"
    assert source["media_type"] == "image/png"


def test_nothing_is_fetched_from_a_host_not_allowed(host: str) -> None:
    body = _chat(f"http://{host}/a.png")
    assert anyio.run(lambda: fetch_remote_media(body, ("example.com",), timeout_s=1)) == body
    assert anyio.run(lambda: fetch_remote_media(body, (), timeout_s=1)) == body


@pytest.mark.parametrize(
    ("path", "error", "code"),
    [
        ("/missing.png", BadRequest, "remote_media_failed"),
        ("/page", BadRequest, "remote_media_failed"),  # not an image/* content type
        ("/moved", BadRequest, "remote_media_failed"),  # a redirect is never followed
        ("/empty.png", BadRequest, "remote_media_failed"),
        ("/huge.png", TooLarge, "media_too_large"),
    ],
)
def test_a_fetch_that_fails_is_refused_typed(
    host: str, path: str, error: type[Exception], code: str
) -> None:
    with pytest.raises(error) as info:
        _fetch(_chat(f"http://{host}{path}"), (host,))
    assert getattr(info.value, "code", None) == code


def test_a_fetch_that_stalls_past_the_timeout_is_refused_typed(host: str) -> None:
    with pytest.raises(BadRequest) as info:
        _fetch(_chat(f"http://{host}/stalls.png"), (host,), timeout_s=0.5)
    assert info.value.code == "remote_media_failed"


@pytest.mark.parametrize(
    ("url", "allowed", "expected"),
    [
        ("http://img.test/a.png", ("img.test",), True),
        ("https://IMG.test:8443/a.png", ("img.test:8443",), True),
        ("https://img.test/a.png", ("img.test:443",), True),
        ("http://img.test:8080/a.png", ("img.test:80",), False),
        ("http://evil.test/a.png?img.test", ("img.test",), False),
        ("http://img.test@evil.test/a.png", ("img.test",), False),
        ("ftp://img.test/a.png", ("img.test",), False),
        ("http://img.test:99999/a.png", ("img.test",), False),
    ],
)
def test_only_the_allowed_hosts_match(url: str, allowed: tuple[str, ...], expected: bool) -> None:
    assert host_allowed(url, allowed) is expected


def test_the_option_takes_hosts_only() -> None:
    assert GateConfig.from_texts({"allow_remote_media": "a.test,b.test:81"}).allow_remote_media == (
        "a.test",
        "b.test:81",
    )
    with pytest.raises(ConfigError) as info:
        GateConfig(allow_remote_media=("http://a.test/",))
    assert info.value.code == "bad_allow_remote_media"
