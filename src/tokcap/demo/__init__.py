"""The ``tokcap demo`` room: the black-box harness, the model families, checks and report.

Public here: the harness's tool list and tool-call helpers (tests reuse them) and the model
families the demo serves. The command itself is ``tokcap demo`` (`tokcap.__main__`).
"""

from ._families import (
    CHATML_TOOLS_TEMPLATE,
    ENGINE_ARGS,
    FAMILIES,
    QWEN_VLLM_ARGS,
    ModelFamily,
    chatml_tool_args,
    model_family,
)
from ._harness import TOOLS, forced_tool_calls, tool_result

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "ENGINE_ARGS",
    "FAMILIES",
    "QWEN_VLLM_ARGS",
    "TOOLS",
    "ModelFamily",
    "chatml_tool_args",
    "forced_tool_calls",
    "model_family",
    "tool_result",
]
