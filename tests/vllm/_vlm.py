"""What the tiny-VLM tests share: images as PNG bytes and data URLs, chat messages carrying
them, a loopback HTTP host serving them, and transformers' own processor as the reference
for an expanded prompt; `moved` (seeded noise on a model's weights) serves the weight
tests too."""

from __future__ import annotations

import base64
import contextlib
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of ``width`` x ``height`` pixels whose colours depend on ``seed``."""
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata(
        [((x * 7 + seed) % 256, (y * 11 + seed) % 256, (x * y + seed) % 256)
         for y in range(height) for x in range(width)]
    )  # fmt: skip
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """``data`` as a base64 data URL."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(data: bytes, text: str = "What is in the picture?") -> dict[str, Any]:
    """A user chat message: the image, then ``text``."""
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(data)}},
            {"type": "text", "text": text},
        ],
    }


Routes = dict[str, tuple[int, str, bytes]]
"""What an `ImageRoutes` serves: path -> status, content type, body."""


class ImageRoutes(BaseHTTPRequestHandler):
    """Answers a GET of a path in ``routes`` (path -> status, content type, body) with that
    route, anything else with a 404; subclasses set ``routes``."""

    routes: ClassVar[Routes] = {}

    def do_GET(self) -> None:
        self.reply(*self.routes.get(self.path, (404, "text/plain", b"no")))

    def reply(self, status: int, mime: str, data: bytes) -> None:
        """Send ``data`` as a whole response."""
        self.send_response(status)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve_images(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 from a thread of its own, for the block: ``host:port``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def chat_turns(
    oai: Any, model: str, messages: list[dict[str, Any]], follow_ups: list[dict[str, Any]]
) -> tuple[list[list[int]], list[list[int]]]:
    """One chat call (``return_token_ids``, 4 tokens) on ``messages``, then one more after
    each follow-up: the reply's content goes back as the assistant's turn, then the
    follow-up. The engine's prompt ids and output ids of each call; every call's prompt
    must extend its parent's exact ids (asserted)."""
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for follow_up in [*follow_ups, None]:
        reply = oai.chat.completions.create(
            model=model, messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
        )
        prompts.append((reply.model_extra or {})["prompt_token_ids"])
        outputs.append((reply.choices[0].model_extra or {})["token_ids"])
        if follow_up is not None:
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append(follow_up)
    for parent_prompt, parent_output, prompt in zip(prompts, outputs, prompts[1:], strict=False):
        parent = parent_prompt + parent_output
        assert prompt[: len(parent)] == parent
    return prompts, outputs


def token_id(model: Path, token: str) -> int:
    """The id of the special ``token`` in the model's tokenizer."""
    from transformers import AutoTokenizer

    found: int = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(token)
    return found


def processor_ids(model: Path, messages: list[dict[str, Any]], images: list[bytes]) -> list[int]:
    """The prompt ids transformers' processor (saved with the model) makes of ``messages``."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    parts = [
        [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
        if isinstance(m["content"], list)
        else m["content"]
        for m in messages
    ]
    chat = [{"role": m["role"], "content": c} for m, c in zip(messages, parts, strict=True)]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    ids: list[int] = processor(text=text, images=pil)["input_ids"][0]
    return list(ids)


def moved(model: Any, seed: int, scale: float = 0.05, only: str = "") -> dict[str, Any]:
    """``model``'s state dict with seeded noise on its parameters named ``only*`` (the tied
    head follows the text embedding; ``model`` keeps the noise)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(only):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def vlm_parity(model: Any, weights: dict[str, Any], rows: Any, media: Any) -> Any:
    """The engine's captured logprobs in ``rows`` against ``model`` holding ``weights``, fed
    the rows' verified image tensors ``media`` (`tokcap_core.LogprobParity`)."""
    import torch

    from tokcap.train import collate, media_inputs, token_logprobs
    from tokcap_core import logprob_parity

    model.load_state_dict(weights)
    with torch.no_grad():
        recomputed = token_logprobs(model, collate(rows), inputs=media_inputs(rows, media))
    return logprob_parity(
        [row.logprobs for row in rows],
        [recomputed[i, : len(row.input_ids)].tolist() for i, row in enumerate(rows)],
        [row.loss_mask for row in rows],
        valid_N=[row.sample_mask for row in rows],
    )
