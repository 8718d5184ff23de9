"""The ``idefics3`` demo family's pieces that need no engine: its template renders what the
text template renders, content given as strings or as lists of parts; its harness's images
are deterministic PNGs; the report draws each image a row
carries as a thumbnail over its tokens."""

from __future__ import annotations

import io
from typing import Any

import jinja2
import pytest

from tokcap.demo import image_part, picture
from tokcap.tiny import CHATML_TOOLS_IMAGES_TEMPLATE, CHATML_TOOLS_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
TRANSCRIPT: list[dict[str, Any]] = [
    {"role": "system", "content": "Solve it."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "calc", "arguments": '{"a": 2}'}}],
    },
    {"role": "tool", "content": "2 + 3 = 5"},
    {"role": "tool", "content": "again"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Use the tool."},
    {"role": "assistant", "content": None, "tool_calls": [{"name": "calc", "arguments": {}}]},
]


def render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages, **kwargs)


def as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as vLLM hands it to a template that iterates parts."""
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]}
    return message


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("generation", [True, False])
def test_the_images_template_renders_text_as_the_text_template(
    tools: Any, generation: bool
) -> None:
    want = render(CHATML_TOOLS_TEMPLATE, TRANSCRIPT, tools=tools, add_generation_prompt=generation)
    for messages in (TRANSCRIPT, [as_parts(m) for m in TRANSCRIPT]):
        got = render(
            CHATML_TOOLS_IMAGES_TEMPLATE, messages, tools=tools, add_generation_prompt=generation
        )
        assert got == want


def test_an_image_is_one_placeholder_where_its_part_stands() -> None:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and?"}]},
        {"role": "tool", "content": [{"type": "text", "text": "7"}, {"type": "image"}]},
    ]
    text = render(CHATML_TOOLS_IMAGES_TEMPLATE, messages, tools=TOOLS)
    assert "<|im_start|>user\n<image>and?<|im_end|>" in text
    assert "<tool_response>\n7<image>\n</tool_response>" in text


def test_pictures_are_deterministic_pngs() -> None:
    from PIL import Image

    png = picture("task/What is 2 + 3?")
    assert png == picture("task/What is 2 + 3?") != picture("task/What is 2 + 4?")
    assert Image.open(io.BytesIO(png)).size == (48, 48)
    assert image_part(png)["image_url"]["url"].startswith("data:image/png;base64,")
