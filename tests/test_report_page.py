"""The demo report as a page, without an engine: synthetic rollouts (``simulate_rollout``)
rendered by ``render_report`` and loaded in headless Chromium, a trajectory picked, the
plots found. (tests/e2e/test_demo.py checks the same on a real demo run.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.chromium import dump_dom
from tokcap.demo import Drift, render_report
from tokcap_core import assemble_receipt, reassemble, verify_manifest
from tokcap_core.simulate import simulate_rollout


class Letters:
    """A stand-in tokenizer: each id decodes to a letter (the report only decodes)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def page(tmp_path: Path) -> tuple[Path, int]:
    samples, per_rollout = [], []
    for n in range(6):
        rollout = simulate_rollout(f"r{n}", seed=n, turns=2, reward=n / 5)
        receipt = assemble_receipt(verify_manifest(rollout.manifest))
        (row,) = reassemble(receipt, rollout.calls, max_seq_len=4096)
        drift = Drift(
            rollout_id=row.rollout_id, row_len=len(row.input_ids), retok_len=len(row.input_ids),
            first_diff=row.prompt_len + 1,
            retok_ids=[*row.input_ids.tolist()[: row.prompt_len + 1], 7, 7, 7],
        ) if n % 2 else None  # fmt: skip
        samples.append((row, receipt, drift))
        per_rollout.append({
            "rollout_id": row.rollout_id, "group": n // 3, "behaviour": "keeps_history",
            "reward": n / 5, "advantage": n / 5 - 0.5, "drift_at": drift and drift.first_diff,
        })  # fmt: skip
    counts = {"total": 0}
    summary: dict[str, Any] = {
        "rollouts": {"verified": 6, "total": 6}, "calls": {"total": 12},
        "tokens": {"total": sum(len(s[0].input_ids) for s in samples)},
        "rows": {"valid": 6, "placeholder": 0},
        "engine_parity": {"rows_differing": 0, "rows_checked": 6, "calls_checked": 12,
                          "max_logprob_abs_diff": 0.0},
        "drift": {"trajectories_drifted": 3, "trajectories_checked": 6},
        "terminal_selection": {"declared": 6}, "failures": {}, "breaks": counts,
        "splices": counts, "advantages": {"placeholder_rows_nonzero": 0},
        "timings_s": {"all": 1.0}, "per_rollout": per_rollout,
        "config": {"groups": 2, "rollouts": 3, "turns": 2, "segments": "terminal"},
    }  # fmt: skip
    path = tmp_path / "report.html"
    path.write_text(render_report(summary, samples, Letters()))
    return path, len(samples)


def test_the_report_picks_a_trajectory_and_shows_its_plots_in_chromium(tmp_path: Path) -> None:
    report, count = page(tmp_path)
    html = report.read_text()
    assert "http://" not in html
    assert "https://" not in html
    dom = dump_dom(f"{report.as_uri()}#t3", tmp_path / "profile")
    sections = re.findall(r'<section class="traj" id="(t\d+)"( hidden="")?', dom)
    assert len(sections) == count
    assert [s for s, hidden in sections if not hidden] == ["t3"]
    assert dom.count('<option value="t') == count
    plots = set(re.findall(r'<svg class="plot" data-plot="(\w+)"', dom))
    assert plots == {"reward", "advantage", "length", "logprob"}
    assert dom.count('<details class="prompt">') == count  # every prompt starts folded
    assert dom.count("<th>re-tokenised</th>") == 3  # the drifted ones: captured beside retok
