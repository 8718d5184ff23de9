"""The model families ``tokcap demo --model-family`` serves, each the way its users serve it.

- ``qwen`` (default): the tiny Qwen3 model of `tokcap.tiny` with a ChatML template that
  renders tools, vLLM's ``hermes`` tool parser (`tokcap.tiny.QWEN_VLLM_ARGS`); tool calls
  forced with an xgrammar structural tag (`tokcap.demo._harness.forced_tool_calls`). The
  gate plans prompts in text.
- ``mistral``: a tiny ``MistralForCausalLM`` next to the real Tekken tokenizer that
  ``mistral_common`` ships (`tokcap.tiny`), served with ``--tokenizer-mode
  mistral`` and the ``mistral`` tool parser, as Mistral's model cards ask; tool calls forced
  with a regex and a bias on ``[TOOL_CALLS]`` (`tokcap.tiny.force_tool_calls`). The
  gate plans prompts in token ids (``mistral_common`` renders requests straight to ids).
- ``idefics3``: the tiny Idefics3 vision-language model of `tokcap.tiny` (`build_tiny_vlm`)
  with `CHATML_TOOLS_IMAGES_TEMPLATE` (the ``qwen`` family's tools, images in user and tool
  messages) and the ``hermes`` parser; the harness sends a picture with the task and one
  inside the first tool answer (`tokcap.demo._images`); the engine expands each into its
  image tokens and the gate binds the bytes and the processed tensors to the call. Chat
  only (the Responses and Messages harnesses send no images).

A family also says how the demo's independent checks load its tokenizer and re-tokenise a
transcript (the text-based baseline the report compares the captured rows against).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..tiny import CHATML_TOOLS_TEMPLATE, ENGINE_ARGS, QWEN_VLLM_ARGS
from ._harness import TOOLS, Api, forced_tool_calls

__all__ = ["FAMILIES", "ModelFamily", "episode_api", "model_family"]

FAMILIES: Final = ("qwen", "mistral", "idefics3")
"""The names ``--model-family`` accepts (the first is the default)."""

_API_SLOTS: Final[dict[int, Api]] = {0: "responses", 2: "messages"}


def episode_api(family: str, group: int, slot: int) -> Api:
    """The API rollout ``slot`` of ``group`` is played with: in every odd group of the
    ``qwen`` family, slot 0 (``response_id``) speaks the Responses API and slot 2
    (``declared``) Anthropic Messages; everything else chat. The ``mistral`` family forces
    tool calls with a ``logit_bias`` neither API carries, so it speaks chat only."""
    if family != "qwen" or group % 2 == 0:
        return "chat"
    return _API_SLOTS.get(slot, "chat")


# A calc call's arguments as the tool's JSON schema allows them (integers 0..99).
_CALC_ARGUMENTS: Final = r'\{"a": (\d|[1-9]\d), "op": "[-+*]", "b": (\d|[1-9]\d)\}'


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFamily:
    """One way of serving a model: its folder, vLLM options, tool forcing and checks."""

    name: str
    model: Path
    """The model folder vLLM serves (built locally, cached)."""
    vllm_args: tuple[str, ...]
    force_tools: Callable[[int], dict[str, Any]]
    """``count`` → request fields (``extra_body``) that force ``count`` tool calls."""
    load_tokenizer: Callable[[], Any]
    """The tokenizer the checks and the report decode with (transformers-compatible)."""
    retokenize: Callable[[Any, Sequence[dict[str, Any]]], list[int]]
    """``(tokenizer, messages)`` → the ids a text-based trainer would train on."""
    tools_every_turn: bool = False
    """Whether the harness calls tools on every turn but the last (no user nudges)."""
    images: bool = False
    """Whether the harness sends images (a picture of the task, one in a tool answer)."""


def model_family(name: str, cache: Path) -> ModelFamily:
    """Build (or reuse, under ``cache``) the tiny model of family ``name``.

    Raises `ValueError` for a name not in `FAMILIES`.
    """
    if name == "qwen":
        return _qwen(cache)
    if name == "mistral":
        return _mistral(cache)
    if name == "idefics3":
        return _vlm(cache)
    raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")


def _image_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a chat template takes them: each ``image_url`` part an ``image``."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = [{"type": "image"} if p.get("type") == "image_url" else p for p in content]
            m = {**m, "content": parts}
        out.append(m)
    return out


def _vlm(cache: Path) -> ModelFamily:
    from ..tiny import CHATML_TOOLS_IMAGES_TEMPLATE, VLM_TOOLS_VLLM_ARGS, build_tiny_vlm

    model = build_tiny_vlm(cache / "tiny" / "vlm")
    return _chatml("idefics3", model, CHATML_TOOLS_IMAGES_TEMPLATE, VLM_TOOLS_VLLM_ARGS, True)


def _qwen(cache: Path) -> ModelFamily:
    from ..tiny import build_tiny_model

    model = build_tiny_model(cache / "tiny" / "dense", kind="dense")
    return _chatml("qwen", model, CHATML_TOOLS_TEMPLATE, QWEN_VLLM_ARGS, False)


def _chatml(
    name: str, model: Path, template: str, vllm_args: tuple[str, ...], images: bool
) -> ModelFamily:
    """A family served with a ChatML tool ``template`` and vLLM's ``hermes`` parser, tool
    calls forced with the Hermes structural tag; its checks re-tokenise with ``template``
    (one ``<image>`` per picture, where the engine expanded each)."""

    def load_tokenizer() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)

    def retokenize(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
        text = tokenizer.apply_chat_template(
            _image_parts(messages),
            tools=list(TOOLS),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=False,
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    return ModelFamily(
        name=name,
        model=model,
        vllm_args=vllm_args,
        force_tools=lambda count: forced_tool_calls(TOOLS, count),
        load_tokenizer=load_tokenizer,
        retokenize=retokenize,
        images=images,
    )


def _mistral(cache: Path) -> ModelFamily:
    from ..tiny import force_tool_calls, tiny_mistral

    model, args = tiny_mistral(cache / "tiny")
    calc = {"calc": _CALC_ARGUMENTS}

    def load_tokenizer() -> Any:
        from transformers.tokenization_mistral_common import MistralCommonBackend

        return MistralCommonBackend.from_pretrained(str(model))

    def retokenize(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
        # mistral_common renders requests for serving: a transcript that ends on the
        # assistant's answer is rendered as that answer continued (no end-of-turn token).
        encoded = tokenizer.apply_chat_template(
            list(messages), tools=list(TOOLS), tokenize=True, continue_final_message=True
        )
        ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
        return [int(i) for i in ids]

    return ModelFamily(
        name="mistral",
        model=model,
        vllm_args=(*ENGINE_ARGS, *args),
        force_tools=lambda count: force_tool_calls(model, calc, calls=count),
        load_tokenizer=load_tokenizer,
        retokenize=retokenize,
        # With tools offered, Mistral's v3 tokenizers put the tool list before the *last*
        # user message: a user nudge re-renders the history (a `template_unstable` root).
        tools_every_turn=True,
    )
