"""The pictures the demo's harness shows a vision-language model (``--model-family idefics3``).

Small seeded PNGs, made with Pillow: the task's picture goes with the first user message
(an ``image_url`` part, a base64 data URL), and a picture of the calculator's first answer
goes inside that answer's ``role: "tool"`` message, so each rollout carries one image from
the user and one from a tool result. The tiny model is random: the pictures only need to be
real images whose bytes the gate hashes and whose tokens the engine expands.
"""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

__all__ = ["image_part", "picture", "sha256"]

_SIDE = 48


def picture(key: str) -> bytes:
    """A 48x48 PNG whose pixels depend only on ``key``."""
    from PIL import Image

    seed = hashlib.sha256(key.encode()).digest()
    image = Image.new("RGB", (_SIDE, _SIDE))
    image.putdata(
        [
            ((x * seed[0] + y) % 256, (y * seed[1] + x) % 256, (x * y + seed[2]) % 256)
            for y in range(_SIDE)
            for x in range(_SIDE)
        ]
    )
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_part(png: bytes) -> dict[str, Any]:
    """An OpenAI chat ``image_url`` content part carrying ``png`` as a base64 data URL."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def sha256(data: bytes) -> str:
    """The plain SHA-256 (hex) the gate binds an image's bytes by."""
    return hashlib.sha256(data).hexdigest()
