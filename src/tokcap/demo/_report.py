"""``report.html``: one self-contained page (inline CSS and JS, no network) about a demo run.

Key figures, inline SVG plots (reward, advantage and length per group; the distribution of
the generated tokens' logprobs), the rollout table, then every trajectory behind a picker
(``report.html#t3`` opens the fourth), its prompt collapsed, in a per-token view: carried
tokens (prompt, tool output, template text) in grey, generated tokens in blue shaded by
the sampled token's probability, a marker where each call starts (amber, with its cause,
where the call was *spliced*: it kept its parent's exact ids although the template renders
the parent's turn differently), the receipt's chain with how each prompt was formed and
shortened digests (the full value on hover, copied on click), and the first position where
re-tokenising the transcript would have changed the ids, the captured ids beside the
re-tokenised ones. An image's tokens (the engine's expansion of its placeholder, as the
row's ``media`` places them) are tinted violet behind a thumbnail of the image as the
harness sent it, found by the SHA-256 the receipt names.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tokcap_core import Receipt, TrainingRow
from tokcap_core.receipts import ReceiptCall
from tokcap_core.staged import MediaItem

from .._fleet_view import fleet_table
from ._checks import Drift
from ._plots import group_strips, histogram

__all__ = ["render_report"]

_CSS = """
:root{--fg:#1f2328;--mute:#656d76;--line:#d0d7de;--gen:37,99,235;--carry:#eef0f3;--bad:#d1242f}
*{box-sizing:border-box}body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;
color:var(--fg);margin:0;background:#f6f8fa}main{max-width:1320px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}h3{font-size:15px;margin:0}
.sub{color:var(--mute)}.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));
gap:10px;margin-top:16px}.card{background:#fff;border:1px solid var(--line);border-radius:8px;
padding:10px 12px}.card b{display:block;font-size:20px}.card span{color:var(--mute);font-size:12px}
.card.ok b{color:#1a7f37}.card.warn b{color:#9a6700}.grid{display:grid;
grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:12px}.wide{grid-column:1/-1}
table{border-collapse:collapse;background:#fff;width:100%}td,th{border:1px solid var(--line);
padding:3px 8px;text-align:left;font-size:13px}th{background:#f0f2f5}td.n{text-align:right;
font-variant-numeric:tabular-nums}.traj{background:#fff;border:1px solid var(--line);
border-radius:8px;padding:14px;margin:14px 0}.meta{color:var(--mute);margin:4px 0 10px}
.tag{display:inline-block;padding:0 6px;border-radius:10px;background:#ddf4ff;color:#0550ae;
font-size:12px;margin-right:4px}
.tag.bad{background:#ffebe9;color:var(--bad)}code,.tokens{font-family:ui-monospace,SFMono-Regular,
Menlo,Consolas,monospace}.dg{cursor:pointer;border-bottom:1px dotted var(--mute)}
.tokens{white-space:pre-wrap;word-break:break-all;font-size:12.5px;line-height:1.9;margin-top:10px;
border:1px solid var(--line);border-radius:6px;padding:8px;background:#fff}
.t{border-radius:2px;padding:1px 0}.c{background:var(--carry);color:#57606a}
.g{background:rgba(var(--gen),var(--a));color:#0b1f44}.g.hi{color:#fff}
.cb{display:inline-block;font-size:10.5px;background:#1f2328;color:#fff;border-radius:3px;
padding:0 4px;margin:0 3px 0 6px;line-height:1.5}.cb.sp{background:#bf8700}
.tag.sp{background:#fff8c5;color:#7d4e00}.drift{outline:2px solid var(--bad);
outline-offset:1px;position:relative}.after{text-decoration:underline wavy rgba(209,36,47,.45)}
.legend span{margin-right:14px}.sw{display:inline-block;width:14px;height:12px;vertical-align:-1px;
margin-right:4px;border-radius:2px}.ids .t{font-size:11px}.note{font-size:12.5px;color:var(--mute)}
.traj[hidden]{display:none}details.prompt>summary{cursor:pointer;color:var(--mute);
font-size:12px}select{font:inherit;padding:3px 6px;max-width:100%}.plots{display:flex;
flex-wrap:wrap;gap:12px}.plots svg{background:#fff;border:1px solid var(--line);border-radius:8px}
svg text{font:11px system-ui,sans-serif;fill:#57606a}
table.cmp td{font-family:ui-monospace,monospace}
.im{background:#f3e8ff;color:#6e40c9}.thumb{height:56px;vertical-align:middle;
border:2px solid #8250df;border-radius:4px;margin:2px 4px;image-rendering:pixelated}
button{font:inherit;font-size:12px;padding:2px 8px;border:1px solid var(--line);border-radius:6px;
background:#fff;cursor:pointer}
"""
_JS = """
const picker=document.getElementById('picker');
function pick(id){document.querySelectorAll('section.traj').forEach(s=>{s.hidden=s.id!==id;});
 if(picker)picker.value=id;}
if(picker){picker.addEventListener('change',()=>{pick(picker.value);history.replaceState(null,'','#'+picker.value);});
 const want=location.hash.slice(1);pick(document.getElementById(want)?want:picker.value);}
document.querySelectorAll('.dg').forEach(e=>e.addEventListener('click',()=>{
 navigator.clipboard&&navigator.clipboard.writeText(e.title);}));
document.querySelectorAll('button[data-ids]').forEach(b=>b.addEventListener('click',()=>{
 const box=document.getElementById(b.dataset.ids);const ids=box.classList.toggle('ids');
 box.querySelectorAll('.t').forEach(t=>{const v=ids?t.dataset.id+' ':t.dataset.s;t.textContent=v;});
 b.textContent=ids?'show text':'show token ids';}));
"""


_LOGPROB_FLOOR = 10.0
"""Generated tokens shade from logprob 0 (dark) to -10 or below (light)."""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _digest(value: str) -> str:
    return f'<span class="dg" title="{_e(value)}">{_e(value[:12])}…</span>'


def _card(label: str, value: str, kind: str = "") -> str:
    return f'<div class="card {kind}"><b>{_e(value)}</b><span>{_e(label)}</span></div>'


def _kv_table(title: str, items: Sequence[tuple[str, object]]) -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td class=n>{_e(v)}</td></tr>" for k, v in items)
    return f"<div><h3>{_e(title)}</h3><table>{body}</table></div>"


def _chain_table(receipt: Receipt, segment: int) -> str:
    head = (
        "<tr><th>call</th><th>parent</th><th>formed</th><th>staging key</th><th>prefix</th>"
        "<th>carry</th><th>gen</th><th>finish</th><th>call digest</th><th>chain hash</th></tr>"
    )
    body = "".join(
        f"<tr><td><code>{_e(c.call_id)}</code></td><td><code>{_e(c.parent_id or '—')}</code></td>"
        f"<td>{_e(_formed(c))}</td><td><code>{_e(c.staging_key)}</code></td>"
        f"<td class=n>{c.prefix_len}</td>"
        f"<td class=n>{c.carry_len}</td><td class=n>{c.gen_len}</td><td>{_e(c.finish_reason)}</td>"
        f"<td><code>{_digest(c.call_digest)}</code></td><td><code>{_digest(c.chain_hash)}</code></td></tr>"
        for c in receipt.segments[segment]
    )
    return f"<table>{head}{body}</table>"


def _formed(call: ReceiptCall) -> str:
    return f"splice ({call.splice_cause})" if call.formation == "splice" else call.formation


def _token_text(piece: str) -> str:
    return piece.replace("\n", "↵\n").replace("\t", "⇥\t")


def _thumb(item: MediaItem, images: Mapping[str, bytes]) -> str:
    """A thumbnail of the image ``item`` binds (by its bytes' SHA-256), its span in the title."""
    where = f"image · tokens [{item.offset}, {item.end}) · sha256 {item.bytes_sha256}"
    data = images.get(item.bytes_sha256)
    if data is None:
        return f'<span class="cb" title="{_e(where)}">image {_digest(item.bytes_sha256)}</span>'
    src = "data:image/png;base64," + base64.b64encode(data).decode()
    return f'<img class="thumb" src="{src}" alt="image" title="{_e(where)}">'


def _tokens(
    row: TrainingRow,
    pieces: Sequence[str],
    drift: Drift | None,
    box_id: str,
    links: Mapping[str, ReceiptCall],
    images: Mapping[str, bytes],
) -> str:
    starts = {s.start: s for s in row.call_spans}
    media = {m.offset: m for m in row.media}
    inside = {i for m in row.media for i in range(m.offset, m.end)}
    cut = drift.first_diff if drift is not None else None
    prompt: list[str] = []
    rest: list[str] = []
    for i, (tid, piece) in enumerate(zip(row.input_ids, pieces, strict=True)):
        out = prompt if i < row.prompt_len else rest
        span = starts.get(i)
        if span is not None:
            link = links.get(span.call_id)
            spliced = link is not None and link.formation == "splice"
            note = f" · spliced: {link.splice_cause}" if spliced and link else ""
            out.append(
                f'<span class="cb{" sp" if spliced else ""}" '
                f'title="carry {span.carry_len} · gen {span.gen_len}{_e(note)}">'
                f"{_e(span.call_id)}</span>"
            )
        if i in media:
            out.append(_thumb(media[i], images))
        text = _token_text(piece)
        classes = ["t"]
        title = f"#{i} · id {tid}"
        if row.loss_mask[i]:
            p = math.exp(row.logprobs[i])
            # Log scale: a random model's tokens sit near log(1/vocab), far from p = 1.
            alpha = 0.12 + 0.78 * min(1.0, max(0.0, 1.0 + row.logprobs[i] / _LOGPROB_FLOOR))
            classes.append("g hi" if alpha > 0.6 else "g")
            style = f' style="--a:{alpha:.2f}"'
            title += f" · logprob {row.logprobs[i]:.3f} (p={p:.2f})"
        else:
            classes.append("im" if i in inside else "c")
            style = ""
        if cut is not None and i == cut:
            classes.append("drift")
            theirs = drift.retok_ids[i : i + 6] if drift is not None else []
            title += f" · re-tokenising gives {theirs} here"
        elif cut is not None and i > cut:
            classes.append("after")
        out.append(
            f'<span class="{" ".join(classes)}"{style} title="{_e(title)}" data-id="{tid}" '
            f'data-s="{_e(text)}">{_e(text)}</span>'
        )
    folded = (
        f'<details class="prompt"><summary>prompt: {len(prompt)} carried tokens (click to '
        f"expand)</summary>{''.join(prompt)}</details>"
        if prompt
        else ""
    )
    return f'<div class="tokens" id="{box_id}">{folded}{"".join(rest)}</div>'


def _drift_compare(
    row: TrainingRow, drift: Drift | None, pieces: Sequence[str], retok: Sequence[str]
) -> str:
    """At the first drift: the captured ids beside the ids re-tokenising the text gives."""
    if drift is None or drift.first_diff is None:
        return ""
    at = drift.first_diff
    lo = max(0, at - 3)

    def cells(ids: Sequence[int], text: Sequence[str]) -> str:
        return "".join(
            f"<td{' class=drift' if lo + k == at else ''}>{ids[lo + k]}<br>"
            f"{_e(_token_text(text[lo + k]))}</td>"
            for k in range(min(9, len(ids) - lo))
        )

    return (
        f'<p class="note">At position {at} re-tokenising the transcript stops matching what the '
        "engine saw. tokcap trains on the captured ids; a trainer working from text would "
        f'have trained on the second line:</p><table class="cmp"><tr><th>captured</th>'
        f"{cells(row.input_ids.tolist(), pieces)}</tr><tr><th>re-tokenised</th>"
        f"{cells(drift.retok_ids, retok)}</tr></table>"
    )


def _trajectory(
    n: int, row: TrainingRow, receipt: Receipt, info: dict[str, Any], pieces: Sequence[str],
    drift: Drift | None, retok_pieces: Sequence[str], images: Mapping[str, bytes],
) -> str:  # fmt: skip
    tags = [f'<span class="tag">{_e(info["behaviour"])}</span>']
    tags.append(f'<span class="tag">API: {_e(info.get("api", "chat"))}</span>')
    tags.append(f'<span class="tag">terminal: {_e(receipt.terminal_selection)}</span>')
    tags += [f'<span class="tag bad">break: {_e(c)}</span>' for c in receipt.break_causes]
    tags += [f'<span class="tag sp">splice: {_e(c)}</span>' for c in receipt.splice_causes]
    if row.media:
        tags.append(f'<span class="tag">images: {len(row.media)}</span>')
    if row.segment:
        tags.append(f'<span class="tag">extra segment {row.segment}</span>')
    if drift is not None and drift.first_diff is not None:
        tags.append(f'<span class="tag bad">re-tokenising drifts at {drift.first_diff}</span>')
    elif drift is not None:
        tags.append('<span class="tag">re-tokenising: identical</span>')
    box = f"tok{n}"
    links = {c.call_id: c for c in receipt.segments[row.segment]}
    compare = _drift_compare(row, drift, pieces, retok_pieces)
    meta = (
        f"{len(row.input_ids)} tokens ({row.num_generated} generated) · reward "
        f"{info['reward']:.3f} · advantage {info['advantage']:+.3f} · ledger head "
        f"{receipt.ledger_head[0]}:{_digest(receipt.ledger_head[1])}"
    )
    return (
        f'<section class="traj" id="t{n}"><h3>{_e(row.key)} {"".join(tags)} '
        f'<button data-ids="{box}">show token ids</button></h3><div class="meta">{meta}</div>'
        f"{_chain_table(receipt, row.segment)}{compare}"
        f"{_tokens(row, pieces, drift, box, links, images)}"
        "</section>"
    )


def _api_table(apis: Mapping[str, Mapping[str, Any]]) -> str:
    """Rollouts, calls and verified rollouts per API the harness spoke, with its client."""
    rows = "".join(
        f"<tr><td>{_e(api)}</td><td class=n>{n['rollouts']}</td><td class=n>{n['calls']}</td>"
        f"<td class=n>{n['verified']}</td><td>{_e(n['client'])}</td></tr>"
        for api, n in apis.items()
    )
    return (
        '<div class="wide"><h3>APIs the harness spoke</h3><table><tr><th>API</th><th>rollouts</th>'
        f"<th>calls</th><th>verified</th><th>client</th></tr>{rows}</table></div>"
    )


def _cell(rollout: dict[str, Any], column: str) -> object:
    value = rollout.get(column)
    if column in ("breaks", "splices"):
        return ", ".join(value or ()) or "—"
    return "—" if value is None else value


def _rollout_table(per_rollout: Sequence[dict[str, Any]]) -> str:
    columns = ("rollout_id", "behaviour", "api", "calls", "on_chain", "status", "terminal",
               "segments", "breaks", "splices", "reward", "advantage", "drift_at")  # fmt: skip
    head = "".join(f"<th>{_e(c.replace('_', ' '))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{_e(_cell(r, c))}</td>" for c in columns) + "</tr>"
        for r in per_rollout
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _plots(
    summary: dict[str, Any], samples: Sequence[tuple[TrainingRow, Receipt, Drift | None]]
) -> str:
    per = summary["per_rollout"]
    groups = sorted({r["group"] for r in per})
    lengths: dict[int, list[float]] = {g: [] for g in groups}
    group_of = {r["rollout_id"]: r["group"] for r in per}
    logprobs: list[float] = []
    for row, _, _ in samples:
        if row.segment == 0:
            lengths[group_of[row.rollout_id]].append(float(len(row.input_ids)))
        logprobs += [lp for lp, m in zip(row.logprobs.tolist(), row.loss_mask, strict=True) if m]

    def by_group(key: str) -> list[tuple[str, list[float]]]:
        return [(f"g{g}", [float(r[key]) for r in per if r["group"] == g]) for g in groups]

    return '<div class="plots">' + "".join(
        (
            group_strips("reward", "reward per group", by_group("reward")),
            group_strips("advantage", "advantage per group", by_group("advantage")),
            group_strips(
                "length", "trajectory length (tokens) per group",
                [(f"g{g}", lengths[g]) for g in groups],
            ),
            histogram("logprob", "logprob of each generated token", logprobs),
        )
    ) + "</div>"  # fmt: skip


def render_report(
    summary: dict[str, Any],
    samples: Sequence[tuple[TrainingRow, Receipt, Drift | None]],
    tokenizer: Any,
    images: Mapping[str, bytes] | None = None,
) -> str:
    """The whole page, as one HTML string; ``images`` (the harness's, by the SHA-256 of their
    bytes) give the thumbnails of the images the rows carry."""
    images = images or {}
    ro, rows, tok = summary["rollouts"], summary["rows"], summary["tokens"]
    par, drift = summary["engine_parity"], summary["drift"]
    cards = "".join(
        (
            _card("rollouts verified", f"{ro['verified']} / {ro['total']}", "ok"),
            _card("model calls", str(summary["calls"]["total"])),
            _card("tokens in valid rows", f"{tok['total']:,}"),
            _card("rows valid + placeholder", f"{rows['valid']} + {rows['placeholder']}"),
            _card(
                "rows differing from the engine",
                f"{par['rows_differing']} / {par['rows_checked']}",
                "ok" if par["rows_differing"] == 0 else "warn",
            ),
            _card(
                "trajectories kept exact that re-tokenising would have changed",
                f"{drift['trajectories_drifted']} / {drift['trajectories_checked']}",
                "ok",
            ),
        )
    )
    tables = "".join(
        (
            _kv_table("Terminal selection", list(summary["terminal_selection"].items())),
            _kv_table(
                "Failures and breaks",
                [(f"failure: {k}", f"{v:g}") for k, v in summary["failures"].items() if v]
                + [
                    (f"break: {k}", f"{v:g}")
                    for k, v in summary["breaks"].items()
                    if v or k == "total"
                ]
                + [
                    (f"splice: {k}", f"{v:g}")
                    for k, v in summary.get("splices", {}).items()
                    if v or k == "total"
                ],
            ),
            _kv_table(
                "Checks",
                [
                    (
                        "rows differing from the engine's own ids",
                        f"{par['rows_differing']} / {par['rows_checked']}",
                    ),
                    ("calls compared with the engine", par["calls_checked"]),
                    ("max |logprob - engine logprob|", f"{par['max_logprob_abs_diff']:.3g}"),
                    (
                        "trajectories re-tokenising changes",
                        f"{drift['trajectories_drifted']} / {drift['trajectories_checked']}",
                    ),
                    (
                        "placeholder rows with advantage ≠ 0",
                        summary["advantages"]["placeholder_rows_nonzero"],
                    ),
                ],
            ),
            _api_table(summary.get("apis", {})),
            _kv_table("Timings (s)", list(summary["timings_s"].items())),
        )
    )
    rollouts = _rollout_table(summary["per_rollout"])
    info = {r["rollout_id"]: r for r in summary["per_rollout"]}

    def decode(ids: Sequence[int]) -> list[str]:
        return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    sections = "".join(
        _trajectory(
            n, row, receipt, info[row.rollout_id], decode(row.input_ids.tolist()), d,
            decode(d.retok_ids) if d is not None and d.first_diff is not None else [], images,
        )
        for n, (row, receipt, d) in enumerate(samples)
    )  # fmt: skip
    picker = (
        '<p><label>trajectory <select id="picker">'
        + "".join(
            f'<option value="t{n}">{_e(row.key)} · group {info[row.rollout_id]["group"]} · '
            f"{_e(info[row.rollout_id]['behaviour'])}</option>"
            for n, (row, _, _) in enumerate(samples)
        )
        + f"</select></label> <span class=note>{len(samples)} trajectories: every valid row "
        "of the run</span></p>"
    )
    legend = (
        '<div class="legend note">'
        '<span><i class="sw" style="background:var(--carry)"></i>carried '
        "(prompt, tool output, template)</span>"
        '<span><i class="sw" style="background:rgba(37,99,235,.9)"></i>generated, logprob 0</span>'
        '<span><i class="sw" style="background:rgba(37,99,235,.15)"></i>'
        "generated, logprob &le; -10</span>"
        '<span><i class="cb">c000001</i>call starts</span>'
        '<span><i class="cb sp">c000002</i>call spliced on its parent\'s exact ids</span>'
        '<span><i class="sw" style="outline:2px solid #d1242f"></i>'
        "first token re-tokenising changes (wavy after it)</span>"
        + (
            '<span><i class="sw" style="background:#f3e8ff;border:1px solid #8250df"></i>'
            "an image's tokens (the engine's expansion), after its thumbnail</span>"
            if any(row.media for row, _, _ in samples)
            else ""
        )
        + "</div>"
    )
    cfg = summary["config"]
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>tokcap demo report</title>"
        f"<style>{_CSS}</style></head><body><main><h1>tokcap demo</h1><div class=sub>"
        f"{cfg['groups']} groups x {cfg['rollouts']} rollouts x {cfg['turns']} turns · segments="
        f"{_e(cfg['segments'])} · tiny random model (its text is gibberish; its tokens are exact)"
        f"</div><div class=cards>{cards}</div>{fleet_table(summary.get('gates', []))}"
        f"<h2>Figures</h2><div class=grid>{tables}</div>"
        f"<h2>Plots</h2>{_plots(summary, samples)}"
        f"<h2>Rollouts</h2>{rollouts}<h2>Trajectories</h2>{picker}{legend}{sections}</main><script>{_JS}</script></body></html>"
    )
