"""A run's served gates (``summary.json``'s ``gates``, `tokcap.compose.gate_entries`) shown.

`print_fleet` prints them as a rich table under a run's summary, `fleet_table` as an HTML
table in its report; ``tokcap demo`` and ``tokcap train`` both show them this way. Nothing
here imports Ray, vLLM or TransferQueue (``tokcap show`` prints saved summaries).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["fleet_table", "print_fleet"]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def print_fleet(gates: list[dict[str, Any]], console: Console) -> None:
    """The served gates of a run (``--gates`` / ``--gate``) as a table; nothing without."""
    if not gates:
        return
    fleet = Table(title="gates (tokcap-vllm serve)", box=box.SIMPLE_HEAVY)
    for name in ("gate", "pid", "rollouts", "calls", "weight version", "answering"):
        fleet.add_column(name, justify="right")
    for g in gates:
        fleet.add_row(
            g["url"], str(g["pid"] or "-"), str(g["rollouts"]), str(g["calls"]),
            str(g["weight_version"]), "yes" if g.get("alive", True) else "lost",
        )  # fmt: skip
    console.print(fleet)


def fleet_table(gates: Sequence[Mapping[str, Any]]) -> str:
    """The served gates of a run (``--gates`` / ``--gate``), one row each, under a heading;
    nothing without them (`tokcap demo` and `tokcap train` reports)."""
    if not gates:
        return ""
    rows = "".join(
        f"<tr><td>{_e(g['url'])}</td><td class=n>{_e(g['pid'] or '-')}</td>"
        f"<td class=n>{g['rollouts']}</td><td class=n>{g['calls']}</td>"
        f"<td class=n>{_e(g['weight_version'])}</td>"
        f"<td>{'yes' if g.get('alive', True) else 'lost'}</td></tr>"
        for g in gates
    )
    return (
        f"<h2>Fleet: {len(gates)} gates, each its own tokcap-vllm serve</h2><table><tr>"
        "<th>gate</th><th>pid</th><th>rollouts</th><th>calls</th><th>weight version</th>"
        f"<th>answering</th></tr>{rows}</table>\n"
    )
