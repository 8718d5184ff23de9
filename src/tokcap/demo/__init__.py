"""The ``tokcap demo`` room: the black-box harness, the model families, checks and report.

Public here: the harness's tool list and tool-call helpers (tests reuse them), the model
families the demo serves, and the report's page and plots (`render_report`, `Drift`,
`group_strips`, `histogram`; `fleet_table` and `print_fleet`, a run's served gates, the
train report's and summary's too).
The command itself is ``tokcap demo`` (`tokcap.__main__`).
"""

from ._checks import Drift
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
from ._plots import group_strips, histogram
from ._report import fleet_table, render_report
from ._summary import print_fleet

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "ENGINE_ARGS",
    "FAMILIES",
    "QWEN_VLLM_ARGS",
    "TOOLS",
    "Drift",
    "ModelFamily",
    "chatml_tool_args",
    "fleet_table",
    "forced_tool_calls",
    "group_strips",
    "histogram",
    "model_family",
    "print_fleet",
    "render_report",
    "tool_result",
]
