"""The demo's figures (``summary.json``) and their rich rendering (``tokcap demo`` / ``show``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from tokcap_core import masked_mean
from tokcap_core.metrics import (
    break_cause_counts,
    calls_per_rollout,
    failure_counts,
    splice_cause_counts,
)
from tokcap_core.receipts import TERMINAL_SELECTIONS

from .._fleet_view import print_fleet

if TYPE_CHECKING:  # `tokcap show` must not import Ray, vLLM or TransferQueue
    from ._checks import Drift, Parity
    from ._pipeline import DemoRun

__all__ = ["SUMMARY_VERSION", "build_summary", "print_summary", "summary_console"]

SUMMARY_VERSION = 2
BEHAVIOUR_NOTES = {
    "response_id": "closed with the scored response id as witness",
    "content": "closed with a content fingerprint only (no response id)",
    "declared": "terminal declared by the harness before close (no witness)",
    "rewrite": "summarises earlier turns half-way (history rewritten: a forest)",
    "plain": "closed with no witness (terminal chosen by the deepest-chain heuristic)",
}


def build_summary(
    run: DemoRun, parity: list[Parity], drift: list[Drift], timings_s: dict[str, float]
) -> dict[str, Any]:
    """Every figure of a run as plain JSON (the report and ``tokcap show`` read this)."""
    from tokcap_ray import step_metrics

    receipts = list(run.receipts.values())
    rows, advantages = run.rows, run.advantages
    valid = [r for r in rows if r.sample_mask]
    advantage_of = {
        r.rollout_id: a for r, a in zip(rows, advantages, strict=True) if r.segment == 0
    }
    drift_of = {d.rollout_id: d for d in drift}
    pool = step_metrics(run.groups)
    segment_calls = {
        (r.rollout_id, i): [c.call_id for c in seg]
        for r in receipts
        for i, seg in enumerate(r.segments)
    }
    verified_rows = sum(
        1
        for r in valid
        if run.receipts[r.rollout_id].ok
        and [s.call_id for s in r.call_spans] == segment_calls.get((r.rollout_id, r.segment))
    )
    behaviours = Counter(e.behaviour for e in run.episodes)
    return {
        "version": SUMMARY_VERSION,
        "config": {k: str(v) if k == "model" else v for k, v in asdict(run.config).items()},
        **({"gates": run.gates} if run.gates else {}),
        "rollouts": {
            "total": len(receipts),
            "verified": sum(r.ok for r in receipts),
            "poisoned": sum(not r.ok for r in receipts),
            "groups": len(run.groups),
        },
        "calls": {
            "total": sum(len(e.calls) for e in run.episodes),
            "on_chain": sum(len(seg) for r in receipts for seg in r.segments),
            "on_terminal_chain": sum(len(r.segments[0]) for r in receipts if r.segments),
            "tool_calls": sum(c.tool_calls for e in run.episodes for c in e.calls),
            **{k.removeprefix("calls/"): v for k, v in calls_per_rollout(receipts).items()},
        },
        "tokens": {
            "total": sum(len(r.input_ids) for r in valid),
            "generated": sum(r.num_generated for r in valid),
            "carried": sum(len(r.input_ids) - r.num_generated for r in valid),
        },
        "rows": {
            "total": len(rows),
            "valid": len(valid),
            "placeholder": len(rows) - len(valid),
            "verified": verified_rows,
            "extra_segments": sum(1 for r in valid if r.segment > 0),
        },
        "terminal_selection": {
            m: sum(1 for r in receipts if r.ok and r.terminal_selection == m)
            for m in TERMINAL_SELECTIONS
        },
        # Counts are ints in summary.json (the metrics helpers return floats for gauges).
        "failures": {
            k.removeprefix("failures/"): int(v)
            for k, v in failure_counts(r.failure_reason for r in receipts).items()
        },
        "breaks": {
            k.removeprefix("breaks/"): int(v) for k, v in break_cause_counts(receipts).items()
        },
        "splices": {
            k.removeprefix("splices/"): int(v) for k, v in splice_cause_counts(receipts).items()
        },
        "behaviours": {
            b: {"rollouts": n, "what": BEHAVIOUR_NOTES[b]} for b, n in behaviours.items()
        },
        "apis": _per_api(run),
        **({"images": _images(run)} if any(e.images for e in run.episodes) else {}),
        "engine_parity": {
            "rows_checked": len(parity),
            "calls_checked": sum(p.calls_checked for p in parity),
            "rows_differing": sum(p.differs_at is not None for p in parity),
            "max_logprob_abs_diff": max((p.max_logprob_diff for p in parity), default=0.0),
        },
        "drift": {
            "trajectories_checked": len(drift),
            "trajectories_drifted": sum(d.first_diff is not None for d in drift),
            # Tokens from the first drift on: those a trainer working from text would have
            # got wrong or shifted (the ones before it match the captured ids).
            "tokens_in_drifted": sum(
                d.row_len - d.first_diff for d in drift if d.first_diff is not None
            ),
        },
        "advantages": {
            "estimator": "grpo (valid mask = sample_mask)",
            "placeholder_rows_nonzero": sum(
                1 for r, a in zip(rows, advantages, strict=True) if not r.sample_mask and a != 0.0
            ),
            "min": min(advantages, default=0.0),
            "max": max(advantages, default=0.0),
            "reward_mean_valid": masked_mean(
                [r.reward or 0.0 for r in rows], [float(r.sample_mask) for r in rows]
            )
            if rows
            else 0.0,
        },
        "groups": [
            {
                "group_id": g.group_id,
                "rows_valid": g.valid_row_count,
                "rows_total": g.total_row_count,
                "decision": run.decisions.get(g.group_id, ""),
                "failures": [list(f) for f in g.failures],
            }
            for g in run.groups
        ],
        "per_rollout": [
            {
                "rollout_id": e.rollout_id,
                "group": e.group,
                "behaviour": e.behaviour,
                "api": e.api,
                "calls": len(e.calls),
                "on_chain": len(run.receipts[e.rollout_id].segments[0])
                if run.receipts[e.rollout_id].segments
                else 0,
                "tool_calls": sum(c.tool_calls for c in e.calls),
                "status": run.receipts[e.rollout_id].status,
                "failure_reason": run.receipts[e.rollout_id].failure_reason,
                "terminal": run.receipts[e.rollout_id].terminal_selection,
                "segments": len(run.receipts[e.rollout_id].segments),
                "breaks": list(run.receipts[e.rollout_id].break_causes),
                "splices": list(run.receipts[e.rollout_id].splice_causes),
                "reward": round(e.reward, 4),
                "advantage": round(advantage_of.get(e.rollout_id, 0.0), 4) + 0.0,
                "drift_at": drift_of[e.rollout_id].first_diff if e.rollout_id in drift_of else None,
            }
            for e in run.episodes
        ],
        "pool": {
            k: v for k, v in sorted(pool.items()) if k.startswith(("time/", "groups/", "staging/"))
        },
        "timings_s": {k: round(v, 3) for k, v in timings_s.items()},
    }


def _images(run: DemoRun) -> dict[str, int]:
    """What became of the images the harness sent: how many the ledgers of its verified
    rollouts name (each call's ``Staged`` entry names the SHA-256 of the bytes of every image
    it first carried, so the manifest alone shows which images a call saw), how many the
    valid rows carry and their tokens (the engine's expansion, placeholders included)."""
    from tokcap_core.ledger import Staged

    from ._images import sha256

    sent = named = 0
    for e in run.episodes:
        receipt, manifest = run.receipts.get(e.rollout_id), run.manifests.get(e.rollout_id)
        if receipt is None or not receipt.ok or manifest is None:
            continue
        in_ledger = {
            d
            for entry in manifest.entries
            if isinstance(entry.event, Staged)
            for d in entry.event.media_digests or ()
        }
        sent += len(e.images)
        named += sum(sha256(image) in in_ledger for image in e.images)
    items = [m for r in run.rows if r.sample_mask for m in r.media]
    return {
        "sent_in_verified_rollouts": sent,
        "named_by_their_ledgers": named,
        "in_valid_rows": len(items),
        "tokens_in_valid_rows": sum(m.length for m in items),
    }


def _per_api(run: DemoRun) -> dict[str, dict[str, Any]]:
    """Rollouts, calls and verified rollouts per API the harness spoke (every API listed)."""
    from ._clients import API_NOTES

    return {
        api: {
            "rollouts": sum(e.api == api for e in run.episodes),
            "calls": sum(len(e.calls) for e in run.episodes if e.api == api),
            "verified": sum(
                run.receipts[e.rollout_id].ok
                for e in run.episodes
                if e.api == api and e.rollout_id in run.receipts
            ),
            "client": note,
        }
        for api, note in API_NOTES.items()
    }


def _table(title: str, *columns: str) -> Table:
    table = Table(
        title=title, title_justify="left", title_style="bold", show_edge=False, box=box.SIMPLE_HEAD
    )
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    return table


def summary_console() -> Console:
    """A console for the summary: the terminal's width, or 120 columns in logs and pipes."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """Render a summary dict (as saved in ``summary.json``) as rich tables."""
    console = console or summary_console()
    ro, rows, tok, calls = summary["rollouts"], summary["rows"], summary["tokens"], summary["calls"]
    overview = _table("What was captured", "", "count")
    family = summary.get("config", {}).get("family", "qwen")
    for label, value in (
        ("model family (tiny, random weights)", family),
        ("groups x rollouts", f"{ro['groups']} x {ro['total'] // max(1, ro['groups'])}"),
        ("rollouts verified / poisoned", f"{ro['verified']} / {ro['poisoned']}"),
        ("model calls (on a receipt chain)", f"{calls['total']} ({calls['on_chain']})"),
        (
            "calls spliced on their parent's exact ids",
            f"{summary.get('splices', {}).get('total', 0):g}",
        ),
        ("tool calls (OpenAI tool_calls, parsed by vLLM)", str(calls.get("tool_calls", 0))),
        (
            "tokens in valid rows (generated / carried)",
            f"{tok['total']} ({tok['generated']} / {tok['carried']})",
        ),
        (
            "rows: valid + placeholder = total",
            f"{rows['valid']} + {rows['placeholder']} = {rows['total']}",
        ),
        ("valid rows matching their receipt chain", f"{rows['verified']} / {rows['valid']}"),
        ("extra segments (segments=all)", str(rows["extra_segments"])),
    ):
        overview.add_row(label, value)
    console.print(overview)
    print_fleet(summary.get("gates", []), console)

    paths = _table("Terminal selection · failures · breaks · splices", "", "count")
    for method, n in summary["terminal_selection"].items():
        paths.add_row(f"terminal: {method}", str(n))
    for bucket, n in summary["failures"].items():
        if n:
            paths.add_row(f"failure: {bucket}", f"{n:g}")
    if not any(summary["failures"].values()):
        paths.add_row("failures (any bucket)", "0")
    for cause, n in summary["breaks"].items():
        if n or cause == "total":
            paths.add_row(f"break: {cause}", f"{n:g}")
    for cause, n in summary.get("splices", {}).items():
        if n or cause == "total":
            paths.add_row(f"splice: {cause}", f"{n:g}")
    console.print(paths)

    behaviours = _table("Paths exercised on purpose (per group)", "behaviour", "rollouts", "what")
    behaviours.columns[2].justify = "left"
    for name, info in summary["behaviours"].items():
        behaviours.add_row(name, str(info["rollouts"]), info["what"])
    console.print(behaviours)

    images = summary.get("images")
    if images:
        table = _table("Images (the engine's tokens, bound by their bytes)", "", "count")
        table.add_row("images sent in verified rollouts", str(images["sent_in_verified_rollouts"]))
        table.add_row(
            "named by their ledgers (SHA-256 of the bytes)", str(images["named_by_their_ledgers"])
        )
        table.add_row(
            "image items in valid rows (their tokens)",
            f"{images['in_valid_rows']} ({images['tokens_in_valid_rows']})",
        )
        console.print(table)

    apis = _table("APIs the harness spoke", "API", "rollouts", "calls", "verified", "client")
    apis.columns[4].justify = "left"
    for api, n in summary.get("apis", {}).items():
        apis.add_row(
            api, str(n["rollouts"]), str(n["calls"]), str(n["verified"]), n["client"]
        )  # fmt: skip
    console.print(apis)

    par, drift = summary["engine_parity"], summary["drift"]
    checks = _table("Checks", "", "result")
    checks.add_row(
        "rows differing from the engine's own ids",
        f"{par['rows_differing']} of {par['rows_checked']} ({par['calls_checked']} calls)",
    )
    checks.add_row("max |logprob - engine logprob|", f"{par['max_logprob_abs_diff']:.3g}")
    checks.add_row(
        "trajectories that re-tokenising would change",
        f"{drift['trajectories_drifted']} of {drift['trajectories_checked']}",
    )
    adv = summary["advantages"]
    checks.add_row("placeholder rows with advantage != 0", str(adv["placeholder_rows_nonzero"]))
    checks.add_row("GRPO advantage range", f"[{adv['min']:.3f}, {adv['max']:.3f}]")
    console.print(checks)

    per = _table("Rollouts", "rollout", "path", "API", "receipt / terminal", "chain", "break",
                 "splices", "reward", "adv.", "drift@")  # fmt: skip
    tag = f"{summary['config']['tag']}-"
    for r in summary["per_rollout"]:
        receipt = r["terminal"] if r["failure_reason"] is None else r["failure_reason"]
        splices = Counter(r.get("splices", ()))
        per.add_row(
            r["rollout_id"].removeprefix(tag), r["behaviour"], r.get("api", "chat"), receipt,
            f"{r.get('on_chain', '?')}/{r['calls']}", ",".join(r["breaks"]) or "-",
            ",".join(f"{c}:{n}" for c, n in sorted(splices.items())) or "-", f"{r['reward']:.3f}",
            f"{r['advantage'] + 0.0:+.2f}", "-" if r["drift_at"] is None else str(r["drift_at"]),
        )  # fmt: skip
    console.print(per)

    timings = _table("Timings", "stage", "seconds")
    for stage, seconds in summary["timings_s"].items():
        timings.add_row(stage, f"{seconds:.2f}")
    for key in ("time/fetch_ms/mean", "time/reassemble_ms/mean", "time/publish_ms/mean"):
        if key in summary["pool"]:
            timings.add_row(
                f"pool {key.split('/')[1]} per group (ms)", f"{summary['pool'][key]:.1f}"
            )
    if "staging/read_ahead_keys" in summary["pool"]:  # read while the close ran: no fetch
        timings.add_row(
            "pool: staged calls read ahead, during the close",
            f"{summary['pool']['staging/read_ahead_keys']:.0f}",
        )
    console.print(timings)
