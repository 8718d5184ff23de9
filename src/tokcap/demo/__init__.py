"""The ``tokcap demo`` room: the black-box harness, the model families, checks and report.

Public here: the harness's tool list and tool-call helpers (tests and benches reuse them:
`forced_tool_calls`, `tool_result`, and one chat call with the tools, `ask_with_tools`, read
with `tool_calls_of` and `engine_reported`), the model
families the demo serves (the tiny Qwen model's engine options are `tokcap.tiny`'s,
re-exported here), and the report's page and plots (`render_report`, `Drift`,
`group_strips`, `histogram`; `fleet_table` and `print_fleet`, a run's served gates, shared
with ``tokcap train``'s report and summary), and the pictures the ``idefics3`` family's
harness sends (`picture`, `image_part`).
The command: `run_demo` on `DemoOptions` (what ``tokcap demo`` runs, from `tokcap.__main__`),
its summary printed by `print_summary` (``tokcap show``).
"""

from .._fleet_view import fleet_table, print_fleet
from ..tiny import CHATML_TOOLS_TEMPLATE, ENGINE_ARGS, QWEN_VLLM_ARGS, chatml_tool_args
from ._checks import Drift
from ._cli import DemoOptions, run_demo
from ._families import FAMILIES, ModelFamily, model_family
from ._harness import (
    TOOLS,
    ask_with_tools,
    engine_reported,
    forced_tool_calls,
    tool_calls_of,
    tool_result,
)
from ._images import image_part, picture
from ._plots import group_strips, histogram
from ._report import render_report
from ._summary import print_summary, summary_console

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "ENGINE_ARGS",
    "FAMILIES",
    "QWEN_VLLM_ARGS",
    "TOOLS",
    "DemoOptions",
    "Drift",
    "ModelFamily",
    "ask_with_tools",
    "chatml_tool_args",
    "engine_reported",
    "fleet_table",
    "forced_tool_calls",
    "group_strips",
    "histogram",
    "image_part",
    "model_family",
    "picture",
    "print_fleet",
    "print_summary",
    "render_report",
    "run_demo",
    "summary_console",
    "tool_calls_of",
    "tool_result",
]
