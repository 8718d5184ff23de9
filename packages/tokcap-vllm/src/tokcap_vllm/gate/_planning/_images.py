"""Each image decoded once before a call that carries it is admitted.

vLLM decodes a request's images after the gate admitted the call: bytes that are no image,
a truncated image or one of zero size answer vLLM's own untyped 400, and a decompression
bomb (Pillow's ``DecompressionBombError``, which vLLM does not catch) a 500. The gate
decodes each image first (Pillow, which vLLM brings; once per server and image, by its
bytes' SHA-256) and refuses, typed, before anything reaches the ledger: 400 ``bad_image``
(Pillow cannot decode it, or it has no pixels), 413 ``media_too_large`` (more than
`MAX_IMAGE_PIXELS` pixels: the engine would hold the decoded image in memory).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Mapping
from typing import Any, Final

from ...errors import BadRequest, TooLarge
from ...fingerprints import image_bytes

__all__ = ["MAX_IMAGE_PIXELS", "ImageCheck"]

MAX_IMAGE_PIXELS: Final = 1 << 25
"""The most pixels (width x height) an image of a captured call may decode to (~33.5 M)."""
_IMAGE_PARTS: Final = ("image_url", "input_image")
_REMEMBERED: Final = 4096


class ImageCheck:
    """Per server: decodes each image of a request once (the digests it passed are kept)."""

    def __init__(self) -> None:
        self._passed: set[str] = set()

    def check(self, messages: Iterable[Mapping[str, Any]]) -> None:
        """Refuse, typed, any image of chat ``messages`` Pillow cannot decode (module doc)."""
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in _IMAGE_PARTS:
                    self._check(image_bytes(part))

    def _check(self, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if digest in self._passed:
            return
        decode(data)
        if len(self._passed) >= _REMEMBERED:
            self._passed.clear()
        self._passed.add(digest)


def decode(data: bytes) -> tuple[int, int]:
    """The width and height of the image ``data``, after decoding all of it (typed errors:
    module doc)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise TooLarge(
                    "media_too_large",
                    f"the image has {width}x{height} pixels; at most {MAX_IMAGE_PIXELS}",
                )
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise TooLarge("media_too_large", f"the image has too many pixels: {e}") from None
    except (BadRequest, TooLarge):
        raise
    except Exception as e:  # Pillow's decoders raise OSError, SyntaxError, zlib.error, ...
        raise BadRequest(
            "bad_image", f"the image does not decode: {type(e).__name__}: {str(e)[:160]}"
        ) from None
    if width < 1 or height < 1:
        raise BadRequest("bad_image", "the image has no pixels")
    return width, height
