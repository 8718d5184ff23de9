"""Images through a hand-started ``tokcap-vllm serve`` on the tiny VLM (issue #35's done-when).

One ``tokcap-vllm serve`` process (the real CLI) serving the tiny Idefics3 with the TQ sink
on the session's Ray + TransferQueue, its own partitions; the harness is the real
``openai`` client over HTTP (chat, then the Responses API), the trainer this process (the
control plane's client, `TQSink`). A three-turn chat rollout sends a data-URL image on
turn 1 and a second image inside a tool result on turn 2: every call is on one receipt
chain, the row's ids are the engine's expanded ids, the receipt and the manifest name both
images' bytes, their processed tensors come back from TransferQueue verified against the
digests the calls bound, and one flipped byte in a stored pixel tensor fails the
trainer's read. An image named by a client UUID alone is refused.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tests.e2e._gates import ServedGate
from tokcap.compose import served_gate_options
from tokcap.tiny import VLM_VLLM_ARGS, build_tiny_vlm
from tokcap_core import VerificationError, reassemble
from tokcap_core.ledger import Staged
from tokcap_core.sink import fetch_media
from tokcap_core.staged import tensors_digest
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import ControlPlaneClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = TQSinkConfig(
    staging_partition="vlm_staging", training_partition="vlm_training", media_partition="vlm_media"
)


def png(side: int, seed: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (side, side))
    image.putdata(
        [((x * 5 + seed) % 256, (y * 9 + seed) % 256, (x ^ y) % 256)
         for y in range(side) for x in range(side)]
    )  # fmt: skip
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


FIRST, SECOND, THIRD = png(48, 5), png(40, 6), png(48, 7)
TOKEN = "vlm-" + secrets.token_hex(8)


def image(data: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def gate(tq_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGate]:
    import ray

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    model = build_tiny_vlm(cache / "vlm")
    options = [
        *served_gate_options(PARTITIONS, ray.get_runtime_context().gcs_address),
        "--tokcap-return-token-ids",
        "--tokcap-attach-timeout-s",
        "120",
    ]
    log = tmp_path_factory.mktemp("served-vlm") / "gate.log"
    served = ServedGate(model, options, token=TOKEN, log=log, vllm_args=VLM_VLLM_ARGS)
    try:
        served.wait_healthy(TOKEN)
        yield served
    finally:
        served.stop()


async def opened(gate: ServedGate, rid: str) -> str:
    """Open rollout ``rid`` on ``gate``; its rollout URL."""
    async with ControlPlaneClient(gate.url, TOKEN) as cp:
        await cp.open(rid)
    return f"{gate.url}/tokcap/rollouts/{rid}/v1"


async def chat(url: str, messages: list[dict[str, Any]]) -> Any:
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    try:
        return await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            seed=3,
            extra_body={"return_token_ids": True},
        )
    finally:
        await client.close()


def test_three_turns_with_two_images_are_one_verified_chain(gate: ServedGate) -> None:
    sink = TQSink(PARTITIONS)

    async def run() -> None:
        rid = "served-vlm-chat"
        url = await opened(gate, rid)
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [image(FIRST), {"type": "text", "text": "Look."}]}
        ]
        answers = []
        for turn in range(3):
            answer = await chat(url, messages)
            answers.append(answer)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            if turn == 0:  # the tool answers with a picture
                tool = [{"type": "text", "text": "the chart:"}, image(SECOND)]
                messages.append({"role": "tool", "tool_call_id": "call-1", "content": tool})
            else:
                messages.append({"role": "user", "content": "And now?"})
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
            head = await cp.close(rid, reward=1.0)
            (receipt,) = await cp.fetch_receipts([rid], expected_heads={rid: head})
            manifest = await cp.manifest(rid)
            assert receipt.status == "verified"
            (chain,) = receipt.segments
            assert [c.parent_id for c in chain] == [None, chain[0].call_id, chain[1].call_id]
            shas = (hashlib.sha256(FIRST).hexdigest(), hashlib.sha256(SECOND).hexdigest())
            assert [c.media_digests or () for c in chain] == [(shas[0],), (shas[1],), ()]
            named = [e.event.media_digests for e in manifest.entries if isinstance(e.event, Staged)]
            assert named == [(shas[0],), (shas[1],), ()]

            staged = await sink.get(list(receipt.sink_keys))
            (row,) = reassemble(receipt, staged, max_seq_len=4096)
            last = answers[-1]
            assert list(row.input_ids) == [*last.prompt_token_ids, *last.choices[0].token_ids]
            assert [m.bytes_sha256 for m in row.media] == list(shas)
            digests = [m.tensors_digest for m in row.media]
            tensors = await fetch_media(sink, digests)
            assert [tensors_digest(tensors[d]) for d in digests] == digests

            # one flipped byte in the stored pixel tensor of the second image
            (blob,) = await sink.get_media([digests[1]])
            (pixels,) = [raw for name, _, _, raw in tensors[digests[1]] if name == "pixel_values"]
            tampered = bytearray(blob)
            tampered[bytes(blob).index(bytes(pixels)) + 7] ^= 0x01
            await sink.clear_media([digests[1]])
            await sink.put_media({digests[1]: bytes(tampered)})
            with pytest.raises(VerificationError) as info:
                await fetch_media(sink, digests)
            assert info.value.code == "media_tensors_mismatch"
            assert digests[1] in str(info.value)

            await sink.clear(list(receipt.sink_keys))
            await cp.release(rid)

    anyio.run(run)


def test_the_responses_api_captures_an_image_likewise(gate: ServedGate) -> None:
    sink = TQSink(PARTITIONS)

    async def run() -> None:
        rid = "served-vlm-responses"
        url = await opened(gate, rid)
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        data = "data:image/png;base64," + base64.b64encode(THIRD).decode()
        try:
            reply = await client.responses.create(
                model=(await client.models.list()).data[0].id,
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": data, "detail": "auto"},
                            {"type": "input_text", "text": "What is it?"},
                        ],
                    }
                ],
                max_output_tokens=6,
            )
        finally:
            await client.close()
        assert reply.status in ("completed", "incomplete")  # incomplete: max_output_tokens
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
            head = await cp.close(rid, reward=1.0)
            (receipt,) = await cp.fetch_receipts([rid], expected_heads={rid: head})
            assert receipt.status == "verified"
            (call,) = receipt.segments[0]
            assert call.media_digests == (hashlib.sha256(THIRD).hexdigest(),)
            (row,) = reassemble(receipt, await sink.get(list(receipt.sink_keys)), max_seq_len=4096)
            (item,) = row.media
            tensors = await fetch_media(sink, [item.tensors_digest])
            assert tensors_digest(tensors[item.tensors_digest]) == item.tensors_digest
            await sink.clear(list(receipt.sink_keys))
            await cp.release(rid)

    anyio.run(run)


def test_an_image_named_by_a_uuid_alone_is_refused(gate: ServedGate) -> None:
    """A UUID first sent with its bytes, then alone (vLLM would answer the second from its
    cache, never seeing content): both refused before the engine, typed."""
    rid = "served-vlm-uuid"

    async def run() -> None:
        url = await opened(gate, rid)
        with_bytes = {**image(FIRST), "uuid": "img-7"}
        alone = {"type": "image_url", "image_url": None, "uuid": "img-7"}
        for part in (with_bytes, alone):
            with pytest.raises(openai.BadRequestError) as info:
                await chat(url, [{"role": "user", "content": [part]}])
            assert info.value.response.json()["error"]["code"] == "media_uuid_refused"
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
            await cp.close(rid, reward=0.0)  # no call of it reached the engine
            (receipt,) = await cp.fetch_receipts([rid])
            assert receipt.segments == () or receipt.segments == []
            await cp.release(rid)

    anyio.run(run)


def test_a_push_through_the_weight_routes_makes_the_engine_encode_a_seen_image_anew(
    gate: ServedGate,
) -> None:
    """`GateWeightClient` (vLLM's weight routes, ``tokcap_shm``) moves only the vision tower,
    then the same image again: the engine's logprobs are the trainer's with the new weights.
    vLLM's weight-transfer finish keeps the encoder cache; without the client's
    ``/reset_encoder_cache`` the engine reused the image's old encoding. The original weights
    are pushed back after."""
    import torch
    import transformers

    from tests.vllm._vlm import moved, vlm_parity
    from tokcap_core import TrainingRow
    from tokcap_vllm.weights import GateWeightClient

    sink = TQSink(PARTITIONS)
    picture = png(48, 41)
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        gate.model, dtype=torch.float32
    )
    model.train(False)
    original = {name: t.detach().clone() for name, t in model.state_dict().items()}
    vision = moved(model, seed=0, only="model.vision_model.")

    async def rollout(rid: str) -> tuple[list[TrainingRow], dict[str, Any]]:
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
            await cp.open(rid)
        url = f"{gate.url}/tokcap/rollouts/{rid}/v1"
        await chat(
            url,
            [{"role": "user", "content": [image(picture), {"type": "text", "text": "?"}]}],
        )
        async with ControlPlaneClient(gate.url, TOKEN) as cp:
            head = await cp.close(rid, reward=1.0)
            (receipt,) = await cp.fetch_receipts([rid], expected_heads={rid: head})
            assert receipt.status == "verified"
            rows = reassemble(receipt, await sink.get(list(receipt.sink_keys)), max_seq_len=4096)
            media = await fetch_media(sink, [m.tensors_digest for row in rows for m in row.media])
            await sink.clear(list(receipt.sink_keys))
            await cp.release(rid)
        return list(rows), media

    async def push(client: GateWeightClient, weights: dict[str, torch.Tensor]) -> None:
        await client.push(weights, (await client.info()).version + 1)

    async def run() -> None:
        async with GateWeightClient(gate.url, TOKEN) as client:
            rows, media = await rollout("served-vlm-push-a")  # encoded by the original weights
            assert vlm_parity(model, original, rows, media).k3 <= 1e-9
            await push(client, vision)
            try:
                rows, media = await rollout("served-vlm-push-b")
                assert vlm_parity(model, vision, rows, media).k3 <= 1e-9
                assert vlm_parity(model, original, rows, media).k3 > 1e-4
            finally:
                await push(client, original)

    anyio.run(run)
