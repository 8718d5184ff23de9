"""The tiny Idefics3 on vLLM's CPU engine: images served, the engine's expanded ids pinned.

One engine for the module, the tiny VLM (`tokcap.tiny.build_tiny_vlm`) behind the gate; the
harness is the real ``openai`` client over HTTP on 127.0.0.1. Images travel as base64 PNG
data URLs; the reference for the expanded prompt is transformers' own processor saved with
the model, run on the same pixels.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tests.vllm._helpers import close_and_reassemble, control, events, gate_server
from tests.vllm._vlm import (
    chat_turns,
    data_url,
    image_message,
    moved,
    png,
    processor_ids,
    token_id,
    vlm_parity,
)
from tokcap.tiny import IMAGE_TOKEN, VLM_VLLM_ARGS
from tokcap_core import MemorySink, StagedCall
from tokcap_core.ledger import Admitted, Staged
from tokcap_core.sink import fetch_media
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WEIGHT_SYNC = ("--worker-extension-cls", "tokcap_vllm.WeightSyncWorker")


@pytest.fixture(scope="module")
def vlm_server(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    ledger_dir = tmp_path_factory.mktemp("vlm-gate")
    args = [*VLM_VLLM_ARGS, *WEIGHT_SYNC]
    # a loaded 2-core box took 450 s to start
    with gate_server(vlm, args, ledger_dir=ledger_dir, start_timeout=1800) as srv:
        yield srv


def test_engine_expands_images_as_the_processor_does(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """Uncaptured (plain ``/v1``): vLLM's expanded prompt ids equal transformers' processor's,
    for a square and a wide image; each square image is 2x2 tiles + a global view."""
    image_id = token_id(vlm, IMAGE_TOKEN)
    oai = openai.OpenAI(base_url=f"{vlm_server.base_url}/v1", api_key="x", max_retries=0)
    for size in ((48, 48), (96, 40)):
        data = png(*size, seed=size[0])
        messages = [image_message(data)]
        reply = oai.chat.completions.create(
            model=str(vlm),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"return_token_ids": True},
        )
        engine_ids = (reply.model_extra or {})["prompt_token_ids"]
        assert engine_ids == processor_ids(vlm, messages, [data])
        if size == (48, 48):
            assert engine_ids.count(image_id) == 20
            assert len(engine_ids) == 55


def captured_call(
    server: InProcessServer, rollout_id: str, messages: list[dict[str, Any]]
) -> list[int]:
    """One captured chat call over HTTP; the engine's prompt ids as it returned them."""
    oai = openai.OpenAI(base_url=server.rollout_url(rollout_id), api_key="x", max_retries=0)
    reply = oai.chat.completions.create(
        model=server.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    ids: list[int] = (reply.model_extra or {})["prompt_token_ids"]
    return ids


def test_a_captured_image_call_stages_the_expanded_ids_and_binds_the_image(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """The staged row holds exactly what the engine ran (the processor's expanded ids); its
    media item places the image's 33 tokens and binds its bytes, hash, tensors and processor;
    the ledger's ``Staged`` entry names the bytes' SHA-256; the receipt verifies."""
    data = png(48, 48, seed=3)
    messages = [image_message(data)]
    engine_ids = captured_call(vlm_server, "vlm-cap-a", messages)
    assert engine_ids == processor_ids(vlm, messages, [data])
    fake = token_id(vlm, "<fake_token_around_image>")
    start = engine_ids.index(fake)
    end = len(engine_ids) - engine_ids[::-1].index(fake)  # the placeholder's first to last
    image = slice(start, end)
    receipt, rows, staged = close_and_reassemble(vlm_server, "vlm-cap-a")
    assert receipt.ok
    call: StagedCall = staged["c000001"]
    assert call.format == 4
    assert list(call.tokens[: call.carry_len]) == engine_ids
    assert list(rows[0].input_ids[: rows[0].prompt_len]) == engine_ids
    assert call.media is not None
    (item,) = call.media
    assert (item.modality, item.offset, item.length) == ("image", start, end - start)
    assert end - start == 33
    assert item.bytes_sha256 == hashlib.sha256(data).hexdigest()
    (entry,) = [e for e in events(vlm_server, "vlm-cap-a") if isinstance(e, Staged)]
    assert entry.media_digests == (item.bytes_sha256,)
    assert receipt.segments[0][0].media_digests == (item.bytes_sha256,)

    # the same image in another rollout: vLLM's processor cache sends the engine no tensors
    # this time; the gate binds the digest it took when it saw them
    again = captured_call(vlm_server, "vlm-cap-b", [image_message(data, "And now?")])
    _, _, staged_b = close_and_reassemble(vlm_server, "vlm-cap-b")
    assert staged_b["c000001"].media is not None
    (item_b,) = staged_b["c000001"].media
    assert again[image] == engine_ids[image]
    assert (item_b.mm_hash, item_b.tensors_digest, item_b.processor) == (
        item.mm_hash,
        item.tensors_digest,
        item.processor,
    )
    other = captured_call(vlm_server, "vlm-cap-c", [image_message(png(48, 48, seed=4))])
    _, _, staged_c = close_and_reassemble(vlm_server, "vlm-cap-c")
    assert staged_c["c000001"].media is not None
    (item_c,) = staged_c["c000001"].media
    assert other[image] == engine_ids[image]  # same size: same placeholder tokens
    assert item_c.tensors_digest != item.tensors_digest
    assert item_c.mm_hash != item.mm_hash


def _post(server: InProcessServer, rollout_id: str, content: list[dict[str, Any]]) -> Any:
    import httpx

    return httpx.post(
        f"{server.rollout_url(rollout_id)}/chat/completions",
        json={
            "model": server.model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": content}],
        },
        timeout=60,
    )


_PNG = png(8, 8, seed=1)


@pytest.mark.parametrize(
    ("part", "status", "code"),
    [
        ({"type": "image_url", "image_url": None, "uuid": "img-1"}, 400, "media_uuid_refused"),
        (
            {"type": "image_url", "image_url": {"url": data_url(_PNG)}, "uuid": "img-1"},
            400,
            "media_uuid_refused",
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            400,
            "remote_media_refused",
        ),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, 400, "bad_data_url"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
            400,
            "bad_data_url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}},
            400,
            "bad_data_url",
        ),
        (
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + "A" * 28_000_000},
            },
            413,
            "media_too_large",
        ),
        ({"type": "image_embeds", "image_embeds": "AAAA"}, 400, "unsupported_content"),
    ],
)
def test_images_the_gate_cannot_bind_are_refused_typed_and_leave_nothing(
    vlm_server: InProcessServer, part: dict[str, Any], status: int, code: str
) -> None:
    rollout_id = f"vlm-bad-{code}-{len(str(part)) % 997}"
    answer = _post(vlm_server, rollout_id, [part, {"type": "text", "text": "what?"}])
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert rollout_id not in vlm_server.gate.rollouts()


def test_a_uuid_first_sent_with_bytes_then_alone_is_refused_through_the_openai_client(
    vlm_server: InProcessServer,
) -> None:
    """The real ``openai`` client: neither the UUID with bytes nor the UUID alone (which
    vLLM would answer from its cache without seeing content) reaches the engine captured."""
    oai = openai.OpenAI(base_url=vlm_server.rollout_url("vlm-uuid"), api_key="x", max_retries=0)
    with_bytes = {"type": "image_url", "image_url": {"url": data_url(_PNG)}, "uuid": "u-1"}
    alone = {"type": "image_url", "image_url": None, "uuid": "u-1"}
    for part in (with_bytes, alone):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(
                model=vlm_server.model,
                messages=[{"role": "user", "content": [part]}],  # type: ignore[list-item]
                max_tokens=2,
            )
        assert info.value.response.json()["error"]["code"] == "media_uuid_refused"


def test_images_in_history_stay_on_one_chain_expanded_once(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """token_in with images: turn 2 resends turn 1 (its image included) and turn 3 adds a
    second image. Each prompt is the parent's exact expanded ids plus the rendered suffix:
    one chain, the first image expanded once at the offset turn 1 recorded, each image bound
    by the call that first carried it."""
    global_img = token_id(vlm, "<global-img>")
    oai = openai.OpenAI(base_url=vlm_server.rollout_url("vlm-turns"), api_key="x", max_retries=0)
    first, second = png(48, 48, seed=11), png(40, 40, seed=12)
    messages: list[dict[str, Any]] = [image_message(first)]
    follow_ups = [image_message(second, "and this one?"), {"role": "user", "content": "go on"}]
    prompts, outputs = chat_turns(oai, vlm_server.model, messages, follow_ups)
    assert [p.count(global_img) for p in prompts] == [1, 2, 2]
    admitted = [e for e in events(vlm_server, "vlm-turns") if isinstance(e, Admitted)]
    assert [e.parent_id for e in admitted] == [None, "c000001", "c000002"]
    receipt, rows, staged = close_and_reassemble(vlm_server, "vlm-turns")
    assert receipt.ok
    assert list(rows[0].input_ids) == prompts[2] + outputs[2]
    media = [staged[c].media for c in ("c000001", "c000002", "c000003")]
    assert [len(m or ()) for m in media] == [1, 1, 0]
    assert [m[0].bytes_sha256 for m in media[:2] if m] == [
        hashlib.sha256(first).hexdigest(),
        hashlib.sha256(second).hexdigest(),
    ]
    links = receipt.segments[0]
    assert [len(c.media_digests or ()) for c in links] == [1, 1, 0]


def test_responses_input_image_and_messages_image_blocks_capture_likewise(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """The Responses API (``input_image``) and Anthropic Messages (``image`` blocks): the
    staged row holds the engine's expanded ids and one media item binding the bytes."""
    import httpx

    data = png(48, 48, seed=21)
    expected = processor_ids(vlm, [image_message(data, "Describe.")], [data])
    bodies = {
        "responses": {
            "model": vlm_server.model,
            "max_output_tokens": 4,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(data)},
                        {"type": "input_text", "text": "Describe."},
                    ],
                }
            ],
        },
        "messages": {
            "model": vlm_server.model,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": base64.b64encode(data).decode(),
                            },
                        },
                        {"type": "text", "text": "Describe."},
                    ],
                }
            ],
        },
    }
    for api, body in bodies.items():
        rollout_id = f"vlm-api-{api}"
        answer = httpx.post(f"{vlm_server.rollout_url(rollout_id)}/{api}", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        receipt, _, staged = close_and_reassemble(vlm_server, rollout_id)
        assert receipt.ok
        call = staged["c000001"]
        assert list(call.tokens[: call.carry_len]) == expected, api
        assert call.media is not None
        assert [m.bytes_sha256 for m in call.media] == [hashlib.sha256(data).hexdigest()]


def test_processed_tensors_are_stored_once_shared_and_freed_with_the_last_rollout(
    vlm_server: InProcessServer,
) -> None:
    """Two rollouts (group siblings) send one image; one of them resends it in its history
    on turn 2. The sink holds its processed tensors once, under the tensors digest every
    item and row names; the trainer's read verifies them (pixel values and the other
    tensors vLLM's processor made); the blob stays while a held rollout names it and is
    freed with the last release."""
    data = png(44, 44, seed=21)
    sink = vlm_server.gate.sink
    assert isinstance(sink, MemorySink)
    before = set(vlm_server.call(sink.media_keys))
    captured_call(vlm_server, "vlm-blob-a", [image_message(data)])
    oai = openai.OpenAI(base_url=vlm_server.rollout_url("vlm-blob-b"), api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [image_message(data)]
    for _ in range(2):
        reply = oai.chat.completions.create(
            model=vlm_server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "and?"},
        ]
    _, rows_a, _ = close_and_reassemble(vlm_server, "vlm-blob-a")
    receipt, rows_b, staged_b = close_and_reassemble(vlm_server, "vlm-blob-b")
    assert receipt.ok
    assert len(receipt.segments[0]) == 2
    (item,) = rows_a[0].media
    assert rows_b[0].media == staged_b["c000001"].media == (item,)
    assert staged_b["c000002"].media == ()  # the image in its history is turn 1's blob
    added = set(vlm_server.call(sink.media_keys)) - before
    assert added == {item.tensors_digest}
    tensors = vlm_server.call(fetch_media, sink, [item.tensors_digest])[item.tensors_digest]
    names = {name for name, *_ in tensors}
    assert "pixel_values" in names, names

    async def release(rollout_id: str) -> list[str]:
        async with control(vlm_server) as cp:
            await cp.release(rollout_id)
        return await sink.media_keys()

    assert item.tensors_digest in anyio.run(release, "vlm-blob-a")  # b still names it
    assert item.tensors_digest not in anyio.run(release, "vlm-blob-b")


def test_the_trainer_recomputes_the_engines_logprobs_on_the_verified_tensors(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """The trainer's side, on rows with images: a transformers Idefics3 fed the blobs the
    gate staged (read back and verified; no image processor) gives the engine's logprobs:
    parity K3 within the text-only bar (1e-9). Two rollouts of one image and one of
    another, two turns each."""
    import torch
    import transformers

    from tokcap.train import TrainConfig, Trainer

    sink = vlm_server.gate.sink
    assert isinstance(sink, MemorySink)
    rows = []
    for name, seed in (("vlm-par-a", 31), ("vlm-par-b", 31), ("vlm-par-c", 32)):
        oai = openai.OpenAI(base_url=vlm_server.rollout_url(name), api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [image_message(png(48, 48, seed=seed), "Digits?")]
        for turn in range(2):
            reply = oai.chat.completions.create(
                model=vlm_server.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=6,
                temperature=1.0,
                seed=turn,
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]
        receipt, got, _ = close_and_reassemble(vlm_server, name)
        assert receipt.ok
        rows += got
    digests = [item.tensors_digest for row in rows for item in row.media]
    assert len(digests) == 3
    assert len(set(digests)) == 2
    media = vlm_server.call(fetch_media, sink, digests)
    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    model.train(False)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        config=TrainConfig(pad_token_id=0),
    )
    report = trainer.step(rows, [1.0, -1.0, 0.5], media=media)
    assert report.parity.tokens == sum(r.num_generated for r in rows)
    # measured: K3 2.8e-14, max |diff| 4.8e-7 over 36 tokens (the text-only figure's order)
    assert report.parity.k3 <= 1e-9, report.parity


def test_a_push_makes_the_engine_encode_an_image_it_saw_again_with_the_new_weights(
    vlm_server: InProcessServer, vlm: Path
) -> None:
    """A push resets the engine's encoder cache: an image encoded before a push that moved
    only the vision tower is encoded again by the new weights (the engine's logprobs are the
    trainer's with the new weights, not the old). Without the reset the engine core died on
    that call (vLLM's "Encoder cache miss": the reload empties the worker's cache, not the
    scheduler's book of it). Then a push moving everything: the text model and the head tied
    to its embedding land too (before, the push left the head out and CPU vLLM's packed copy
    of it stayed stale: K3 1.6e-3 for noise of 1e-2 on the text model). The original weights
    are pushed back after."""
    import torch
    import transformers

    from tokcap_core import LogprobParity, TrainingRow
    from tokcap_vllm import WeightSync

    sink = vlm_server.gate.sink
    assert isinstance(sink, MemorySink)
    image = png(48, 48, seed=41)

    def rollout(name: str) -> list[TrainingRow]:
        oai = openai.OpenAI(base_url=vlm_server.rollout_url(name), api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [image_message(image, "Digits?")]
        oai.chat.completions.create(
            model=vlm_server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=1.0,
            seed=0,
        )
        receipt, rows, _ = close_and_reassemble(vlm_server, name)
        assert receipt.ok
        return rows

    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    model.train(False)
    original = {name: t.detach().clone() for name, t in model.state_dict().items()}
    vision = moved(model, seed=0, only="model.vision_model.")
    everything = moved(model, seed=1)  # the text model and its tied head too

    def parity(weights: dict[str, torch.Tensor], rows: list[TrainingRow]) -> LogprobParity:
        digests = [item.tensors_digest for row in rows for item in row.media]
        return vlm_parity(model, weights, rows, vlm_server.call(fetch_media, sink, digests))

    def push(weights: dict[str, torch.Tensor]) -> None:
        vlm_server.call(sync.push, weights, sync.state.version + 1)

    engine = vlm_server._server.config.app.state.engine_client
    sync = vlm_server.call(WeightSync.connect, engine)
    before = rollout("vlm-push-a")  # the engine encodes the image with the original weights
    assert parity(original, before).k3 <= 1e-9
    push(vision)
    try:
        after = rollout("vlm-push-b")
        assert parity(vision, after).k3 <= 1e-9, parity(vision, after)
        assert parity(original, after).k3 > 1e-4  # the vision tower's move reached the engine
        push(everything)
        last = rollout("vlm-push-c")
        assert parity(everything, last).k3 <= 1e-9, parity(everything, last)
    finally:
        push(original)
