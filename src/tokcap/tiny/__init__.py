"""Tiny models built locally for tests, the demo and benchmarks (no hub download).

- `build_tiny_tokenizer` / `build_tiny_model`: a byte-level BPE with ChatML specials and a
  random-weight Qwen3 (dense or MoE), hidden 64, 2 layers;
- `build_small_model`: a ~100M Qwen3 of the same family (for benchmarks);
- `tiny_mistral` / `build_tiny_mistral`: a tiny ``MistralForCausalLM`` next to a real
  ``mistral_common`` tokenizer, with the vLLM options and tool forcing Mistral's cards ask for;
- `build_tiny_vlm`: a tiny random Idefics3 vision-language model with its processor
  (`VLM_VLLM_ARGS`, `VLM_CHAT_TEMPLATE`: each image part one `IMAGE_TOKEN`, expanded by
  the engine; `VLM_TOOLS_VLLM_ARGS` with tool calls, `CHATML_TOOLS_IMAGES_TEMPLATE`);
- `ENGINE_ARGS` / `QWEN_VLLM_ARGS`: the CPU engine's options, and the tiny Qwen model's
  (its tool calls: `CHATML_TOOLS_TEMPLATE`, vLLM's ``hermes`` parser, `chatml_tool_args`).

Every build is deterministic and cached under the folder it is given.
"""

from ._engine import (
    CHATML_TOOLS_IMAGES_TEMPLATE,
    CHATML_TOOLS_TEMPLATE,
    ENGINE_ARGS,
    QWEN_VLLM_ARGS,
    chatml_tool_args,
)
from ._mistral import (
    MISTRAL_TOKENIZERS,
    MistralTokenizerKind,
    build_tiny_mistral,
    force_tool_calls,
    mistral_vllm_args,
    tiny_mistral,
    tool_calls_token_id,
)
from ._qwen import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
)
from ._small import SMALL_SHAPE, build_small_model, parameter_count
from ._vlm import (
    IMAGE_TOKEN,
    VLM_CHAT_TEMPLATE,
    VLM_IMAGE_TOKENS,
    VLM_TOOLS_VLLM_ARGS,
    VLM_VLLM_ARGS,
    build_tiny_vlm,
)

__all__ = [
    "CHATML_TEMPLATE",
    "CHATML_TOOLS_IMAGES_TEMPLATE",
    "CHATML_TOOLS_TEMPLATE",
    "ENGINE_ARGS",
    "IMAGE_TOKEN",
    "MISTRAL_TOKENIZERS",
    "QWEN_VLLM_ARGS",
    "SMALL_SHAPE",
    "SPECIAL_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "VLM_IMAGE_TOKENS",
    "VLM_TOOLS_VLLM_ARGS",
    "VLM_VLLM_ARGS",
    "MistralTokenizerKind",
    "build_small_model",
    "build_tiny_mistral",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "chatml_tool_args",
    "force_tool_calls",
    "mistral_vllm_args",
    "parameter_count",
    "tiny_mistral",
    "tool_calls_token_id",
]
