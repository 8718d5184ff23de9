"""Inline SVG plots for the demo report (no script, no network): per-group strips and a
histogram. Each ``<svg>`` carries ``class="plot"`` and ``data-plot=NAME``."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

__all__ = ["group_strips", "histogram"]

_W, _H, _L, _R, _T, _B = 420, 220, 46, 12, 26, 34


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _ticks(low: float, high: float) -> list[float]:
    if high <= low:
        return [low]
    step = 10 ** math.floor(math.log10((high - low) / 2))
    for mult in (1, 2, 5, 10):
        if (high - low) / (step * mult) <= 5:
            step *= mult
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _frame(name: str, title: str, low: float, high: float, body: str, x_labels: str) -> str:
    plot_h = _H - _T - _B
    y_axis = "".join(
        f'<line x1="{_L}" x2="{_W - _R}" y1="{_y(v, low, high):.1f}" y2="{_y(v, low, high):.1f}" '
        f'stroke="#eaeef2"/><text x="{_L - 4}" y="{_y(v, low, high) + 4:.1f}" '
        f'text-anchor="end">{v:g}</text>'
        for v in _ticks(low, high)
    )
    return (
        f'<svg class="plot" data-plot="{_e(name)}" viewBox="0 0 {_W} {_H}" width="{_W}" '
        f'height="{_H}" role="img" aria-label="{_e(title)}"><title>{_e(title)}</title>'
        f'<text x="{_L}" y="16" style="font-weight:600;fill:#1f2328">{_e(title)}</text>'
        f'{y_axis}<line x1="{_L}" x2="{_L}" y1="{_T}" y2="{_T + plot_h}" stroke="#8c959f"/>'
        f"{body}{x_labels}</svg>"
    )


def _y(value: float, low: float, high: float) -> float:
    span = high - low or 1.0
    return _T + (_H - _T - _B) * (1 - (value - low) / span)


def group_strips(name: str, title: str, groups: Sequence[tuple[str, Sequence[float]]]) -> str:
    """One column per group: a dot per value and a bar at the group's mean."""
    values = [v for _, vs in groups for v in vs]
    low, high = min([0.0, *values]), max([0.0, *values])
    if high == low:
        high = low + 1.0
    width = (_W - _L - _R) / max(1, len(groups))
    parts, labels = [], []
    for i, (label, vs) in enumerate(groups):
        centre = _L + width * (i + 0.5)
        if vs:
            mean = sum(vs) / len(vs)
            y = _y(mean, low, high)
            parts.append(
                f'<line x1="{centre - width * 0.3:.1f}" x2="{centre + width * 0.3:.1f}" '
                f'y1="{y:.1f}" y2="{y:.1f}" stroke="#1f2328" stroke-width="2">'
                f"<title>{_e(label)}: mean {mean:.4g}</title></line>"
            )
        for j, v in enumerate(vs):
            dx = (j - (len(vs) - 1) / 2) * min(6.0, width * 0.5 / max(1, len(vs)))
            parts.append(
                f'<circle cx="{centre + dx:.1f}" cy="{_y(v, low, high):.1f}" r="3.5" '
                f'fill="rgba(37,99,235,.65)"><title>{_e(label)}: {v:.4g}</title></circle>'
            )
        labels.append(
            f'<text x="{centre:.1f}" y="{_H - _B + 16}" text-anchor="middle">{_e(label)}</text>'
        )
    return _frame(name, title, low, high, "".join(parts), "".join(labels))


def histogram(name: str, title: str, values: Sequence[float], *, bins: int = 24) -> str:
    """Counts of ``values`` in ``bins`` equal bins between their min and max."""
    if not values:
        return _frame(name, title, 0.0, 1.0, "", "")
    low, high = min(values), max(values)
    if high == low:
        high = low + 1.0
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - low) / (high - low) * bins))] += 1
    top = max(counts)
    width = (_W - _L - _R) / bins
    bars = "".join(
        f'<rect x="{_L + i * width + 1:.1f}" y="{_y(c, 0, top):.1f}" width="{width - 2:.1f}" '
        f'height="{_y(0, 0, top) - _y(c, 0, top):.1f}" fill="rgba(37,99,235,.7)"><title>'
        f"[{low + i * (high - low) / bins:.3g}, {low + (i + 1) * (high - low) / bins:.3g}): "
        f"{c}</title></rect>"
        for i, c in enumerate(counts)
    )
    labels = (
        f'<text x="{_L}" y="{_H - _B + 16}">{low:.3g}</text>'
        f'<text x="{_W - _R}" y="{_H - _B + 16}" text-anchor="end">{high:.3g}</text>'
    )
    return _frame(name, title, 0, top, bars, labels)
