"""The tiny Idefics3 across turns: an image that arrives in a tool result mid-rollout, on
chat, the Responses API and Anthropic Messages; a history whose image changed; remote
image URLs from the one host the gate allows.

One engine for the module, the tiny VLM (`tokcap.tiny.build_tiny_vlm`) behind a gate that
fetches remote images from a loopback HTTP server (the only network here) and from no other
host; the harness is the real ``openai`` client (Messages over plain HTTP, as ``test_vlm``
sends it). The tool-result rollouts are three turns: a data-URL image in the user message, a
second image inside a tool result, then text. Every call extends its parent's exact expanded
ids; each image is expanded once, bound by the call that first carried it.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import pytest

from tests.vllm._helpers import close_and_reassemble, events, gate_server
from tests.vllm._vlm import (
    ImageRoutes,
    Routes,
    chat_turns,
    data_url,
    image_message,
    png,
    serve_images,
    token_id,
)
from tokcap.tiny import VLM_VLLM_ARGS
from tokcap_core import StagedCall, TrainingRow
from tokcap_core.ledger import Admitted
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIRST, SECOND = png(48, 48, seed=31), png(40, 40, seed=32)
REMOTE = png(48, 48, seed=33)


class _Images(ImageRoutes):
    """Serves `REMOTE` at ``/a.png``; anything else is a 404."""

    routes: ClassVar[Routes] = {"/a.png": (200, "image/png", REMOTE)}


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    with serve_images(_Images) as host:
        yield host


@pytest.fixture(scope="module")
def vlm_server(
    vlm: Path, image_host: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    with gate_server(
        vlm,
        VLM_VLLM_ARGS,
        ledger_dir=tmp_path_factory.mktemp("vlm-turns"),
        start_timeout=1800,
        allow_remote_media=(image_host,),
    ) as srv:
        yield srv


def assert_one_chain_two_images(
    server: InProcessServer, vlm: Path, rollout_id: str
) -> tuple[TrainingRow, dict[str, StagedCall]]:
    """Three calls on one chain; the row holds each image expanded once, where the call that
    first carried it recorded it; the receipt and the manifest name both images' bytes."""
    admitted = [e for e in events(server, rollout_id) if isinstance(e, Admitted)]
    assert [e.parent_id for e in admitted] == [None, "c000001", "c000002"]
    receipt, rows, staged = close_and_reassemble(server, rollout_id)
    assert receipt.ok
    (row,) = rows
    ids = list(row.input_ids)
    assert ids.count(token_id(vlm, "<global-img>")) == 2
    media = [staged[c].media or () for c in ("c000001", "c000002", "c000003")]
    assert [len(m) for m in media] == [1, 1, 0]
    first, second = media[0][0], media[1][0]
    assert (first.bytes_sha256, second.bytes_sha256) == (
        hashlib.sha256(FIRST).hexdigest(),
        hashlib.sha256(SECOND).hexdigest(),
    )
    fake = token_id(vlm, "<fake_token_around_image>")
    for item in (first, second):
        assert ids[item.offset] == fake
        assert ids[item.offset + item.length - 1] == fake
    assert first.offset + first.length <= staged["c000002"].prefix_len <= second.offset
    links = receipt.segments[0]
    assert [c.media_digests or () for c in links] == [
        (first.bytes_sha256,),
        (second.bytes_sha256,),
        (),
    ]
    return row, staged


def test_chat_an_image_in_a_tool_result_is_captured_at_the_turn_it_first_appears(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """Issue #35's done-when, on chat: turn 1 a data-URL image in the user message, turn 2 a
    second image inside a ``role: "tool"`` message's content parts, turn 3 text. Each prompt
    is the parent's exact expanded ids plus the rendered suffix; the row is what the engine
    ran and made."""
    oai = openai.OpenAI(base_url=vlm_server.rollout_url("vlmt-chat"), api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [image_message(FIRST, "Look, then call a tool.")]
    tool_result = {
        "role": "tool",
        "tool_call_id": "t1",
        "content": [
            {"type": "text", "text": "screenshot:"},
            {"type": "image_url", "image_url": {"url": data_url(SECOND)}},
        ],
    }
    follow_ups = [tool_result, {"role": "user", "content": "go on"}]
    prompts, outputs = chat_turns(oai, vlm_server.model, messages, follow_ups)
    row, _ = assert_one_chain_two_images(vlm_server, vlm, "vlmt-chat")
    assert list(row.input_ids) == prompts[2] + outputs[2]


def test_responses_an_input_image_in_a_function_call_output_is_captured(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """The Responses API through the ``openai`` client: turn 2's ``function_call_output``
    carries an ``input_image`` (chained by ``previous_response_id``); turn 3 is text."""
    oai = openai.OpenAI(base_url=vlm_server.rollout_url("vlmt-resp"), api_key="x", max_retries=0)
    inputs: list[list[dict[str, Any]]] = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(FIRST), "detail": "auto"},
                    {"type": "input_text", "text": "Look, then call a tool."},
                ],
            }
        ],
        [
            {
                "type": "function_call_output",
                "call_id": "t1",
                "output": [
                    {"type": "input_text", "text": "screenshot:"},
                    {"type": "input_image", "image_url": data_url(SECOND), "detail": "auto"},
                ],
            }
        ],
        [{"role": "user", "content": "go on"}],
    ]
    previous: str | None = None
    for items in inputs:
        reply = oai.responses.create(
            model=vlm_server.model,
            input=items,  # type: ignore[arg-type]
            max_output_tokens=4,
            **({"previous_response_id": previous} if previous else {}),  # type: ignore[arg-type]
        )
        previous = reply.id
    assert_one_chain_two_images(vlm_server, vlm, "vlmt-resp")


def test_messages_an_image_in_a_tool_result_block_is_captured(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """Anthropic Messages: turn 2's ``tool_result`` block carries an ``image`` block (vLLM
    turns it into a tool message and a user message with the image); turn 3 is text."""

    def image_block(data: bytes) -> dict[str, Any]:
        encoded = base64.b64encode(data).decode()
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": encoded},
        }

    url = f"{vlm_server.rollout_url('vlmt-msgs')}/messages"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [image_block(FIRST), {"type": "text", "text": "Look."}]}
    ]
    follow_ups: list[Any] = [
        [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "screenshot:"}, image_block(SECOND)],
            }
        ],
        "go on",
    ]
    for turn in range(3):
        body = {"model": vlm_server.model, "max_tokens": 4, "messages": messages}
        answer = httpx.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        messages.append({"role": "assistant", "content": answer.json()["content"]})
        if turn < 2:
            messages.append({"role": "user", "content": follow_ups[turn]})
    assert_one_chain_two_images(vlm_server, vlm, "vlmt-msgs")


def test_a_history_whose_image_was_swapped_breaks_with_its_cause_and_verifies(
    vlm_server: InProcessServer,
) -> None:
    """Turn 2 resends turn 1 with other bytes in the image's place: no parent (the image the
    engine would run is not the one the parent's ids hold), a new root whose break cause is
    ``image_changed``; the new root binds the new image and the receipt verifies."""
    rollout_id = "vlmt-swap"
    oai = openai.OpenAI(base_url=vlm_server.rollout_url(rollout_id), api_key="x", max_retries=0)
    answer: list[dict[str, Any]] = []
    for image in (FIRST, SECOND):
        follow_up = [{"role": "user", "content": "go on"}] if answer else []
        messages = [image_message(image), *answer, *follow_up]
        reply = oai.chat.completions.create(
            model=vlm_server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
        )
        answer = [{"role": "assistant", "content": reply.choices[0].message.content}]
    admitted = [e for e in events(vlm_server, rollout_id) if isinstance(e, Admitted)]
    assert [(e.parent_id, e.break_cause) for e in admitted] == [
        (None, None),
        (None, "image_changed"),
    ]
    receipt, _, staged = close_and_reassemble(vlm_server, rollout_id)
    assert receipt.ok
    assert "image_changed" in receipt.break_causes
    assert [m.bytes_sha256 for m in staged["c000002"].media or ()] == [
        hashlib.sha256(SECOND).hexdigest()
    ]


def test_a_remote_image_from_the_allowed_host_is_fetched_once_and_bound(
    vlm_server: InProcessServer, image_host: str
) -> None:
    """The gate fetches the URL itself and hands vLLM a data URL of the bytes it got: the
    staged item binds the SHA-256 of what the server served, on chat and on Messages."""
    url = f"http://{image_host}/a.png"
    oai = openai.OpenAI(base_url=vlm_server.rollout_url("vlmt-remote"), api_key="x", max_retries=0)
    oai.chat.completions.create(
        model=vlm_server.model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "what?"},
                ],
            }
        ],
        max_tokens=2,
    )
    block = {"type": "image", "source": {"type": "url", "url": url}}
    answer = httpx.post(
        f"{vlm_server.rollout_url('vlmt-remote-msgs')}/messages",
        json={
            "model": vlm_server.model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "what?"}]}],
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    for rollout_id in ("vlmt-remote", "vlmt-remote-msgs"):
        receipt, _, staged = close_and_reassemble(vlm_server, rollout_id)
        assert receipt.ok
        assert [m.bytes_sha256 for m in staged["c000001"].media or ()] == [
            hashlib.sha256(REMOTE).hexdigest()
        ]


@pytest.mark.parametrize(
    ("where", "code"),
    [
        ("http://{host}/missing.png", "remote_media_failed"),  # the allowed host answers 404
        ("http://localhost:9/a.png", "remote_media_refused"),  # a host not allowed
    ],
)
def test_a_remote_image_the_gate_may_not_or_could_not_fetch_is_refused_typed(
    vlm_server: InProcessServer, image_host: str, where: str, code: str
) -> None:
    rollout_id = f"vlmt-remote-{code}"
    oai = openai.OpenAI(base_url=vlm_server.rollout_url(rollout_id), api_key="x", max_retries=0)
    part = {"type": "image_url", "image_url": {"url": where.format(host=image_host)}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=vlm_server.model,
            messages=[{"role": "user", "content": [part]}],  # type: ignore[list-item]
            max_tokens=2,
        )
    assert info.value.response.json()["error"]["code"] == code
    assert rollout_id not in vlm_server.gate.rollouts()


def test_an_image_first_sent_uncaptured_is_bound_when_a_captured_call_carries_it(
    vlm_server: InProcessServer,
) -> None:
    """Plain ``/v1`` first: vLLM's processor cache then sends the engine no tensors for the
    image, and the gate binds the digest it took on the uncaptured call (before: a 500
    ``gate_failed``, ``media_tensors_unseen``)."""
    data = png(48, 48, seed=34)
    for base in (f"{vlm_server.base_url}/v1", vlm_server.rollout_url("vlmt-plain-first")):
        oai = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        oai.chat.completions.create(
            model=vlm_server.model,
            messages=[image_message(data)],  # type: ignore[list-item]
            max_tokens=2,
        )
    receipt, _, staged = close_and_reassemble(vlm_server, "vlmt-plain-first")
    assert receipt.ok
    assert [m.bytes_sha256 for m in staged["c000001"].media or ()] == [
        hashlib.sha256(data).hexdigest()
    ]


def test_a_prompt_whose_image_would_pass_the_context_is_refused_never_cut(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """Text that fits the context, then an image whose expansion does not: a 400 before the
    engine runs (vLLM's own, as plain ``/v1`` answers it), no call left behind, no prompt
    cut inside the image."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm)
    per_word = len(tokenizer.encode("hello " * 1000, add_special_tokens=False)) / 1000
    text = "hello " * int(4070 / per_word)
    assert len(tokenizer.encode(text, add_special_tokens=False)) < 4096
    body = {
        "model": vlm_server.model,
        "max_tokens": 2,
        "messages": [image_message(png(48, 48, seed=35), text)],
    }
    captured = httpx.post(
        f"{vlm_server.rollout_url('vlmt-long')}/chat/completions", json=body, timeout=120
    )
    plain = httpx.post(f"{vlm_server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert (captured.status_code, plain.status_code) == (400, 400)
    assert "vlmt-long" not in vlm_server.gate.rollouts()


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"\x89PNG\r\n\x1a\nnot an image", 400, "bad_image"),
        (png(48, 48, seed=36)[:60], 400, "bad_image"),
        (
            base64.b64decode(  # a PNG whose header claims 20000 x 20000 pixels
                "iVBORw0KGgoAAAANSUhEUgAATiAAAE4gCAIAAABsEtFuAAAAC0lEQVR4nGNggAEAAAoAAX+AdF4AAAAASUVORK5CYII="
            ),
            413,
            "media_too_large",
        ),
    ],
)
def test_an_image_that_does_not_decode_or_is_a_bomb_is_refused_typed(
    vlm_server: InProcessServer, data: bytes, status: int, code: str
) -> None:
    """Before: vLLM's untyped 400 after admission, and a 500 for the bomb."""
    rollout_id = f"vlmt-bad-{code}-{len(data)}"
    answer = httpx.post(
        f"{vlm_server.rollout_url(rollout_id)}/chat/completions",
        json={"model": vlm_server.model, "max_tokens": 2, "messages": [image_message(data)]},
        timeout=120,
    )
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert rollout_id not in vlm_server.gate.rollouts()


def test_an_image_refused_after_vllm_processed_it_fails_one_call_then_is_sent_again(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """A prompt past the context is refused after vLLM processed its image, so vLLM believes
    the engine holds the image's tensors and sends none with the next call: that call is not
    served (a typed, retryable 503 ``media_tensors_unseen``: the gate never saw them; off
    the rollout's chain) and has vLLM send them again, so its retry on the same rollout is
    captured and binds the image (before: a 500 ``gate_failed``; before that, every later
    captured call failed until vLLM's cache evicted the image)."""
    from transformers import AutoTokenizer

    data = png(48, 48, seed=37)
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    per_word = len(tokenizer.encode("hello " * 1000, add_special_tokens=False)) / 1000
    too_long = {
        "model": vlm_server.model,
        "max_tokens": 2,
        "messages": [image_message(data, "hello " * int(4070 / per_word))],
    }
    url = vlm_server.rollout_url("vlmt-resend-long")
    assert httpx.post(f"{url}/chat/completions", json=too_long, timeout=120).status_code == 400
    short = {**too_long, "messages": [image_message(data, "Digits?")]}
    url = vlm_server.rollout_url("vlmt-resend")
    failed = httpx.post(f"{url}/chat/completions", json=short, timeout=120)
    assert (failed.status_code, failed.json()["error"]["code"]) == (503, "media_tensors_unseen")
    assert httpx.post(f"{url}/chat/completions", json=short, timeout=120).status_code == 200
    receipt, _, staged = close_and_reassemble(vlm_server, "vlmt-resend")
    assert receipt.ok
    (call_id,) = [c.call_id for segment in receipt.segments for c in segment]  # the retry
    assert [m.bytes_sha256 for m in staged[call_id].media or ()] == [
        hashlib.sha256(data).hexdigest()
    ]
