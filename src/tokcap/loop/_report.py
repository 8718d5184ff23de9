"""``report.html`` of a ``tokcap train`` run: one self-contained page, inline SVG, no network.

Key figures, then the reward curve (mean and best rollout per step), the parity curve
(K3 and mean |Δ| of the trainer's pre-update logprobs against the engine's, log scale,
with the 1e-9 bound), the staleness per step, the driver's event-loop lag, the step time by
stage, a few sampled
answers and the step table.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from .._fleet_view import fleet_table

__all__ = ["render_train_report", "svg_chart"]

_CSS = """
:root{--fg:#1f2328;--mute:#656d76;--line:#d0d7de}*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);margin:0;
background:#f6f8fa}main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}
.sub,.note{color:var(--mute)}.note{font-size:12.5px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:10px;margin-top:16px}
.card{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 12px}
.card b{display:block;font-size:20px}.card span{color:var(--mute);font-size:12px}
.card.ok b{color:#1a7f37}.card.bad b{color:#d1242f}
.chart{background:#fff;border:1px solid var(--line);border-radius:8px;padding:8px}
svg text{font:11px system-ui,sans-serif;fill:#57606a}
table{border-collapse:collapse;background:#fff;width:100%}td,th{border:1px solid var(--line);
padding:3px 8px;text-align:right;font-size:12.5px;font-variant-numeric:tabular-nums}
th{background:#f0f2f5}td.l{text-align:left;font-family:ui-monospace,monospace;word-break:break-all}
.legend span{margin-right:14px;font-size:12px}.sw{display:inline-block;width:12px;height:10px;
margin-right:4px;border-radius:2px}
"""
_COLORS = {
    "generate": "#2563eb",
    "capture_verify": "#16a34a",
    "reassemble": "#9333ea",
    "train": "#ea580c",
    "push": "#dc2626",
}
_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 720, 240, 56, 16, 14, 30


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float, log: bool) -> str:
    return f"{value:.0e}" if log else f"{value:g}"


def svg_chart(
    series: Sequence[tuple[str, Sequence[float | None], str]],
    *,
    y_range: tuple[float, float],
    log: bool = False,
    bound: tuple[str, float] | None = None,
) -> str:
    """A line chart over step index as an inline ``<svg>``: one polyline per series.

    ``log`` plots log10 of the values (values <= 0 or None leave a gap); ``bound`` draws
    a dashed horizontal line with its label.
    """
    low, high = (math.log10(v) for v in y_range) if log else y_range
    count = max((len(values) for _, values, _ in series), default=0)
    plot_w, plot_h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B

    def x(i: int) -> float:
        return _PAD_L + (plot_w * i / (count - 1) if count > 1 else plot_w / 2)

    def y(value: float) -> float | None:
        if log:
            if value <= 0 or not math.isfinite(value):
                return None
            value = math.log10(value)
        value = min(max(value, low), high)
        return _PAD_T + plot_h * (1 - (value - low) / ((high - low) or 1.0))

    parts = [f'<svg viewBox="0 0 {_W} {_H}" width="100%" role="img">']
    ticks = [low + (high - low) * k / 4 for k in range(5)]
    for tick in ticks:
        ty = _PAD_T + plot_h * (1 - (tick - low) / ((high - low) or 1.0))
        label = _fmt(10**tick if log else tick, log)
        parts.append(
            f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{ty:.1f}" y2="{ty:.1f}" '
            f'stroke="#eaeef2"/><text x="{_PAD_L - 6}" y="{ty + 4:.1f}" '
            f'text-anchor="end">{_e(label)}</text>'
        )
    for i in range(count):
        if count <= 12 or i % math.ceil(count / 10) == 0 or i == count - 1:
            parts.append(f'<text x="{x(i):.1f}" y="{_H - 10}" text-anchor="middle">{i}</text>')
    if bound is not None:
        by = y(bound[1])
        if by is not None:
            parts.append(
                f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{by:.1f}" y2="{by:.1f}" '
                f'stroke="#d1242f" stroke-dasharray="5 4"/><text x="{_W - _PAD_R}" '
                f'y="{by - 4:.1f}" text-anchor="end" style="fill:#d1242f">{_e(bound[0])}</text>'
            )
    for label, values, color in series:
        segment: list[str] = []
        runs: list[list[str]] = [segment]
        for i, value in enumerate(values):
            py = None if value is None else y(value)
            if py is None:
                segment = []
                runs.append(segment)
                continue
            segment.append(f"{x(i):.1f},{py:.1f}")
        for run in runs:
            if len(run) > 1:
                parts.append(
                    f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                    f'points="{" ".join(run)}"><title>{_e(label)}</title></polyline>'
                )
            for point in run:
                px, py_ = point.split(",")
                parts.append(f'<circle cx="{px}" cy="{py_}" r="2.2" fill="{color}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _stacked_bars(steps: Sequence[dict[str, Any]]) -> str:
    """Seconds per step, one bar per step, stacked by stage."""
    totals = [sum(s["seconds"].get(k, 0.0) for k in _COLORS) for s in steps]
    top = max(totals, default=1.0) or 1.0
    plot_w, plot_h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    width = plot_w / max(len(steps), 1)
    parts = [f'<svg viewBox="0 0 {_W} {_H}" width="100%" role="img">']
    for k in range(5):
        value = top * k / 4
        ty = _PAD_T + plot_h * (1 - k / 4)
        parts.append(
            f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{ty:.1f}" y2="{ty:.1f}" '
            f'stroke="#eaeef2"/><text x="{_PAD_L - 6}" y="{ty + 4:.1f}" '
            f'text-anchor="end">{value:.1f} s</text>'
        )
    for i, s in enumerate(steps):
        base = _PAD_T + plot_h
        for stage, color in _COLORS.items():
            h = plot_h * s["seconds"].get(stage, 0.0) / top
            base -= h
            parts.append(
                f'<rect x="{_PAD_L + i * width + 1:.1f}" y="{base:.1f}" '
                f'width="{max(width - 2, 1):.1f}" height="{h:.1f}" fill="{color}">'
                f"<title>step {s['step']} {stage}: {s['seconds'].get(stage, 0.0):.2f} s"
                "</title></rect>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _legend(items: Sequence[tuple[str, str]]) -> str:
    spans = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{_e(n)}</span>' for n, c in items
    )
    return f'<div class="legend">{spans}</div>'


def _image_cards(train: dict[str, Any]) -> list[str]:
    """With images (``--model-family idefics3``): sent, bound by verified receipts, in the
    trained rows (all three equal, or the run failed), and the blobs read back verified."""
    if not train.get("images_sent"):
        return []
    counts = (train["images_sent"], train["images_bound"], train["images"])
    kind = "ok" if len(set(counts)) == 1 else "bad"
    return [
        _card("images sent / bound / in rows", " / ".join(map(str, counts)), kind),
        _card("image blobs read back, verified", str(train["image_blobs"])),
    ]


def _terminal_cards(train: dict[str, Any]) -> list[str]:
    """How the verified receipts chose their terminal calls; the declared ones against the
    rollouts that declared one through their close (equal, or the run failed)."""
    terminals = train.get("terminals") or {}
    if not terminals:
        return []
    declared = sum(s.get("declared", 0) for s in train["steps"])
    chose = terminals.get("declared", 0)
    return [
        _card("terminals: " + " / ".join(terminals), " / ".join(map(str, terminals.values()))),
        _card("declared terminals chosen / declared", f"{chose} / {declared}",
              "ok" if chose == declared else "bad"),
    ]  # fmt: skip


def _card(label: str, value: str, kind: str = "") -> str:
    return f'<div class="card {kind}"><b>{_e(value)}</b><span>{_e(label)}</span></div>'


def _shapes(steps: Sequence[dict[str, Any]]) -> str:
    """The rollout shapes played (calls per rollout over the run, tokens per row by step) and
    the engine's calls in flight by step; empty for runs that did not record them."""
    calls: dict[int, int] = {}
    for s in steps:
        for n, count in s.get("calls_per_rollout", {}).items():
            calls[int(n)] = calls.get(int(n), 0) + count
    if not calls:
        return ""
    total = sum(calls.values())
    cells = "".join(f"<td>{n}: {calls[n]} ({calls[n] / total:.0%})</td>" for n in sorted(calls))

    def p90(values: Sequence[int]) -> float | None:
        ordered = sorted(values)
        return float(ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)]) if ordered else None

    longest = [p90(s.get("row_tokens", [])) for s in steps]
    busy = [s["seconds"].get("in_flight") for s in steps]
    series: list[tuple[str, Sequence[float | None], str]] = [
        ("tokens per row, p90 / 10", [None if v is None else v / 10 for v in longest], "#7c3aed")
    ]
    if any(v is not None for v in busy):
        series.append(("calls in flight when busy", busy, "#059669"))
    top = max([1.0, *(v for _, values, _ in series for v in values if v is not None)])
    chart = svg_chart(series, y_range=(0.0, top * 1.1))
    return f"""<h2>Rollout shapes and the engine's batch</h2>
<table><tr><th>calls per rollout</th>{cells}</tr></table>
<div class="chart">{chart}</div>
{_legend([(name, color) for name, _, color in series])}
<p class="note">How many calls each rollout made over the run, the 90th percentile of a trained
row's length (tokens, divided by 10) and the engine's mean calls in flight while it was busy,
step by step. A long tail keeps a lock-step engine waiting on a few rollouts with a nearly
empty batch; an asynchronous loop fills it with the next groups.</p>
"""


def render_train_report(summary: dict[str, Any]) -> str:
    """The whole page as a string (no external resource)."""
    train, config = summary["train"], summary["config"]
    steps = train["steps"]
    ok = train["parity_k3_max"] <= train["parity_k3_limit"]
    lost = train.get("receipts_lost", 0)  # with a gate that stopped answering: not failures
    receipts_ok = train["receipts_verified"] + lost == train["receipts_total"]
    k3_kind = "ok" if ok else "bad"
    receipts = f"{train['receipts_verified']}/{train['receipts_total']}"
    receipts += f" ({lost} lost with their gate)" if lost else ""
    window = min(5, len(steps))  # the summary's reward window (`build_train_summary`)
    cards = "".join(
        [
            _card(f"mean reward, first {window} steps", f"{train['reward_first5']:.3f}"),
            _card(f"mean reward, last {window} steps", f"{train['reward_last5']:.3f}"),
            _card("reward gain", f"{train['reward_gain']:+.3f}", "ok"),
            _card("max parity K3 (bound 1e-9)", f"{train['parity_k3_max']:.1e}", k3_kind),
            _card("receipts verified", receipts, "ok" if receipts_ok else "bad"),
            _card("weight version pushed", f"{train['weight_versions'][-1] if steps else '-'}"),
            _card("seconds per step (median)", f"{train['seconds_per_step_median']:.2f}"),
            *_terminal_cards(train),
            *_image_cards(train),
        ]
    )
    reward_chart = svg_chart(
        [
            ("best rollout", [s["reward_max"] for s in steps], "#93c5fd"),
            ("mean reward", [s["reward_mean"] for s in steps], "#2563eb"),
        ],
        y_range=(0.0, 1.0),
    )
    k3 = [s["parity"]["k3"] for s in steps]
    mean_abs = [s["parity"]["mean_abs"] for s in steps]
    positive = [v for v in k3 + mean_abs if v > 0 and math.isfinite(v)]
    low = 10 ** math.floor(math.log10(min(positive, default=1e-15)))
    high = 10 ** math.ceil(math.log10(max([*positive, 1e-8])))
    parity_chart = svg_chart(
        [("K3", k3, "#16a34a"), ("mean |Δ|", mean_abs, "#9333ea")],
        y_range=(low, high),
        log=True,
        bound=("K3 bound 1e-9", train["parity_k3_limit"]),
    )
    staleness = [s["staleness_max"] for s in steps]
    staleness_chart = svg_chart(
        [("max staleness", [None if v is None else float(v) for v in staleness], "#ea580c")],
        y_range=(0.0, float(max([1, *(v for v in staleness if v is not None)]))),
    )
    lag = [float(s.get("loop_lag_ms_max", 0.0)) for s in steps]
    lag_chart = svg_chart(
        [("loop lag (ms)", lag, "#0891b2")], y_range=(0.0, max([10.0, *lag]) * 1.1)
    )
    rows = "".join(
        f"<tr><td>{s['step']}</td><td>{s['reward_mean']:.3f}</td><td>{s['parity']['k3']:.1e}"
        f"</td><td>{s['parity']['mean_abs']:.1e}</td><td>{s['parity']['max_abs']:.1e}</td>"
        f"<td>{s['parity']['tokens']}</td><td>{s['sampled_version']}→{s['weight_version']}</td>"
        f"<td>{s['staleness_max']}</td><td>{s['rows_valid']}+{s['rows_placeholder']}</td>"
        f"<td>{s['receipts_verified']}/{s['receipts_total']}</td>"
        f"<td>{s['seconds']['total']:.2f}</td></tr>"
        for s in steps
    )
    samples = "".join(
        f"<tr><td>{x['step']}</td><td>{x['reward']:.3f}</td><td class=l>{_e(x['answer'])}</td></tr>"
        for x in summary.get("samples", [])
    )
    fleet = fleet_table(summary.get("gates", []))
    staleness_note = (
        f"Mode {train.get('mode', 'sync')}, bound {train.get('max_staleness', 0)}: "
        f"{train.get('tokens_stale', 0)} tokens trained one or more versions behind, "
        f"{train.get('calls_spanning_versions', 0)} calls spanning a push, "
        f"{train.get('dropped_stale', 0)} groups dropped stale."
    )
    title = (
        f"{config['steps']} steps of {config['groups']} groups x {config['rollouts']} rollouts, "
        f"{config['turns']} call(s) of {config['max_tokens']} tokens each, lr {config['lr']}, "
        f"seed {config['seed']}; tiny {config.get('model_family', 'qwen')} model, "
        f"{config['model_params']:,} parameters"
    )
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>tokcap train</title><style>{_CSS}</style></head><body><main>
<h1>tokcap train: a closed GRPO loop through the gate</h1>
<div class="sub">{_e(title)}. Task: {_e(config["task"])}.</div>
<div class="cards">{cards}</div>
{fleet}<h2>Reward</h2><div class="chart">{reward_chart}</div>
{_legend([("mean reward", "#2563eb"), ("best rollout", "#93c5fd")])}
<h2>Parity: trainer vs engine on each step's captured rows</h2>
<div class="chart">{parity_chart}</div>
{_legend([("K3", "#16a34a"), ("mean |Δ| (nats)", "#9333ea")])}
<p class="note">The trainer's logprobs before its update, recomputed on the exact ids the gate
captured, against the logprobs the engine sampled them with. After every full weight push
both hold the same fp32 weights, so K3 stays near 1e-14; a push that did not land shows up
here first.</p>
<h2>Staleness: weight versions between sampling and training</h2>
<div class="chart">{staleness_chart}</div>
<p class="note">For each step, the largest gap between the weight version a token was sampled
with and the version the trainer updated: 0 is on-policy. {_e(staleness_note)}</p>
<h2>Event-loop lag of the driver</h2>
<div class="chart">{lag_chart}</div>
<p class="note">The largest delay of a 10 ms tick on the loop the pumps, the control-plane
client and TransferQueue's async calls share: something blocking that loop shows up here.</p>
{_shapes(steps)}<h2>Step time by stage</h2><div class="chart">{_stacked_bars(steps)}</div>
{_legend(list(_COLORS.items()))}
<h2>Sampled answers (first rollout)</h2>
<table><tr><th>step</th><th>reward</th><th style="text-align:left">answer</th></tr>
{samples}</table>
<h2>Steps</h2><table><tr><th>step</th><th>reward</th><th>K3</th><th>mean |Δ|</th><th>max |Δ|</th>
<th>tokens</th><th>version</th><th>staleness</th><th>rows</th><th>receipts</th><th>s</th></tr>
{rows}</table></main></body></html>
"""
