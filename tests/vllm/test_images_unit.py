"""Image parts as the gate reads them (no engine): data URLs bound to their bytes' digest,
everything else refused with a stable code; a history that differs from a parent's
conversation only by an image breaks with an image cause (``image_changed``,
``image_dropped``)."""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib
from typing import Any

import pytest

from tests.vllm._tokenizers import chatml_tokenizer
from tests.vllm.test_planning_unit import Rollout
from tokcap.tiny import VLM_CHAT_TEMPLATE
from tokcap_vllm.errors import BadRequest, TooLarge
from tokcap_vllm.fingerprints import (
    MAX_IMAGE_BYTES,
    image_bytes,
    image_digest,
    image_digests,
    message_fingerprints,
    normalize_message,
)
from tokcap_vllm.gate._planning._images import ImageCheck, decode

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
"""Bytes the digests read (no decodable image: planning a call of it is refused)."""


def _png_header(width: int, height: int, pixels: bytes = b"\0" * 10) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose data is ``pixels``."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data).to_bytes(4, "big")
        return len(data).to_bytes(4, "big") + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(pixels))
        + chunk(b"IEND", b"")
    )


def _real_png(width: int, height: int) -> bytes:
    rows = b"".join(b"\0" + b"\x7f" * (3 * width) for _ in range(height))
    return _png_header(width, height, rows)


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
        (part(data=b""), "bad_data_url"),
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


def test_an_image_of_exactly_the_limit_binds_and_one_byte_more_is_413() -> None:
    """Base64 rounds up, so a payload a few bytes over the limit passes the length check
    on the text: the decoded bytes are checked too."""

    def url(size: int) -> dict[str, Any]:
        payload = base64.b64encode(b"\0" * size).decode()
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + payload}}

    at_limit = b"\0" * MAX_IMAGE_BYTES
    assert image_digest(url(MAX_IMAGE_BYTES)) == image_digest(url(MAX_IMAGE_BYTES))
    assert image_bytes(url(MAX_IMAGE_BYTES)) == at_limit
    for over in (1, 2, 3):
        with pytest.raises(TooLarge) as info:
            image_bytes(url(MAX_IMAGE_BYTES + over))
        assert info.value.code == "media_too_large", over


# ---- breaks whose cause is an image --------------------------------------------------------


SEEN, OTHER = _real_png(4, 4), _real_png(4, 5)


def _vlm_rollout() -> Rollout:
    rollout = Rollout(chatml_tokenizer(), VLM_CHAT_TEMPLATE)
    rollout.renderer.takes_images = True
    return rollout


def _look(data: bytes | None, text: str = "what?") -> dict[str, Any]:
    parts = [] if data is None else [part(data)]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _first_turn(rollout: Rollout) -> dict[str, Any]:
    return rollout.call([_look(SEEN)], "a cat")


def test_history_with_its_image_kept_extends_the_parent() -> None:
    rollout = _vlm_rollout()
    answer = _first_turn(rollout)
    plan = rollout.plan([_look(SEEN), answer, {"role": "user", "content": "and?"}])
    assert (plan.parent_id, plan.formation) == ("c000001", "extend")


@pytest.mark.parametrize(
    ("history", "cause"),
    [
        ([_look(OTHER)], "image_changed"),  # other bytes at the same place
        (
            [{**_look(SEEN), "content": [part(SEEN), *_look(SEEN)["content"]]}],
            "image_changed",
        ),  # added
        ([_look(None)], "image_dropped"),  # the image part left out
        ([{"role": "user", "content": "what?"}], "image_dropped"),  # as plain text
        ([_look(SEEN, "what??")], "no_parent_match"),  # the text changed: not the image's doing
    ],
)
def test_a_history_whose_image_changed_or_went_breaks_with_an_image_cause(
    history: list[dict[str, Any]], cause: str
) -> None:
    rollout = _vlm_rollout()
    answer = _first_turn(rollout)
    plan = rollout.plan([*history, answer, {"role": "user", "content": "and?"}])
    assert (plan.parent_id, plan.formation, plan.break_cause) == (None, "root", cause)


def test_a_user_turn_of_images_alone_left_out_is_image_dropped() -> None:
    """As vLLM's Messages conversion makes of a ``tool_result`` with an image: a tool message,
    then a user message of the image alone; a harness that drops the image drops that turn."""
    rollout = _vlm_rollout()
    tool = {"role": "tool", "tool_call_id": "t1", "content": "screenshot:"}
    answer = rollout.call([_look(None), tool, {"role": "user", "content": [part(SEEN)]}], "I see")
    plan = rollout.plan([_look(None), tool, answer, {"role": "user", "content": "go"}])
    assert (plan.parent_id, plan.break_cause) == (None, "image_dropped")


def test_a_text_only_rollout_keeps_its_causes() -> None:
    rollout = Rollout(chatml_tokenizer(), VLM_CHAT_TEMPLATE)
    answer = rollout.call([{"role": "user", "content": "hi"}], "hello")
    plan = rollout.plan([{"role": "user", "content": "hey"}, answer])
    assert plan.break_cause == "no_parent_match"


# ---- each image decoded before admission ----------------------------------------------------


@pytest.mark.parametrize(
    ("data", "error", "code"),
    [
        (b"not an image at all", BadRequest, "bad_image"),
        (_real_png(8, 8)[:40], BadRequest, "bad_image"),  # cut inside its data
        (_png_header(64, 64), BadRequest, "bad_image"),  # the header promises more pixels
        (_png_header(0, 8), BadRequest, "bad_image"),
        (_png_header(9000, 9000), TooLarge, "media_too_large"),  # 81 M pixels
        (_png_header(20000, 20000), TooLarge, "media_too_large"),  # Pillow's bomb error
    ],
)
def test_an_image_that_does_not_decode_or_is_too_large_is_refused_before_admission(
    data: bytes, error: type[Exception], code: str
) -> None:
    check = ImageCheck()
    message = {"role": "user", "content": [part(data), {"type": "text", "text": "x"}]}
    with pytest.raises(error) as info:
        check.check([message])
    assert getattr(info.value, "code", None) == code


def test_an_image_that_decodes_passes_and_is_decoded_once() -> None:
    good = _real_png(8, 6)
    assert decode(good) == (8, 6)
    check = ImageCheck()
    message = {"role": "user", "content": [part(good)]}
    check.check([message, message])
    assert len(check._passed) == 1


def test_the_renderer_of_a_vlm_refuses_an_undecodable_image_typed() -> None:
    rollout = _vlm_rollout()
    with pytest.raises(BadRequest) as info:
        rollout.plan([_look(b"\x89PNG\r\n\x1a\n not really")])
    assert info.value.code == "bad_image"
