"""Image parts as the gate reads them (no engine): data URLs bound to their bytes' digest,
everything else refused with a stable code."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

from tokcap_vllm.errors import BadRequest, TooLarge
from tokcap_vllm.fingerprints import (
    MAX_IMAGE_BYTES,
    image_digest,
    image_digests,
    message_fingerprints,
    normalize_message,
)

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


def part(data: bytes = PNG, mime: str = "image/png", **extra: Any) -> dict[str, Any]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def test_a_data_url_image_is_bound_to_the_sha256_of_its_bytes() -> None:
    message = {"role": "user", "content": [part(), {"type": "text", "text": "what?"}]}
    normal = normalize_message(message)
    assert normal["content"] == [
        {"type": "image", "sha256": hashlib.sha256(PNG).hexdigest()},
        {"type": "text", "text": "what?"},
    ]
    assert image_digests([normal]) == (hashlib.sha256(PNG).hexdigest(),)
    # text-only parts still join into one string, as before
    assert normalize_message({"role": "user", "content": [{"type": "text", "text": "a"}]}) == {
        "role": "user",
        "content": "a",
    }


def test_a_changed_image_changes_the_conversation_fingerprint() -> None:
    def fingerprint(data: bytes) -> str:
        message = {"role": "user", "content": [part(data), {"type": "text", "text": "x"}]}
        return message_fingerprints([normalize_message(message)])[0]

    assert fingerprint(PNG) == fingerprint(PNG)
    assert fingerprint(PNG) != fingerprint(PNG + b"\x00")


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        ({"type": "image_url", "image_url": None, "uuid": "u"}, "media_uuid_refused"),
        (part(uuid="u"), "media_uuid_refused"),
        ({"type": "image_url", "image_url": {"url": "http://h/a.png"}}, "remote_media_refused"),
        ({"type": "image_url", "image_url": {"url": "HTTPS://h/a.png"}}, "remote_media_refused"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "bad_data_url"),
        ({"type": "image_url", "image_url": {}}, "bad_data_url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "bad_data_url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, "bad_data_url"),
        (part(mime="text/plain"), "bad_data_url"),
        (part(data=b""), "media_too_large"),
    ],
)
def test_an_image_the_gate_cannot_bind_is_refused_with_a_stable_code(
    bad: dict[str, Any], code: str
) -> None:
    with pytest.raises((BadRequest, TooLarge)) as info:
        image_digest(bad)
    assert info.value.code == code


def test_an_image_over_the_limit_is_413_before_it_is_decoded() -> None:
    huge = "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES // 3 * 4 + 64)
    with pytest.raises(TooLarge) as info:
        image_digest({"type": "image_url", "image_url": {"url": huge}})
    assert (info.value.code, TooLarge.status) == ("media_too_large", 413)
