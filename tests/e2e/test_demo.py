"""``tokcap demo --quick`` end to end: real vLLM engine, real TransferQueue, real Ray.

One demo run (``--segments all``, in a subprocess, as a user runs it) feeds the summary
and report tests; a second run is interrupted with SIGINT to check that nothing it
started keeps running or listening.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.chromium import dump_dom, run_chromium
from tests.e2e._cli import REPO, cli_env, tokcap, tokcap_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_TIMEOUT_S = 420
DEMO_ARGS = ("demo", "--quick", "--segments", "all", "--out")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo") / "run"
    started = time.monotonic()
    proc = tokcap(*DEMO_ARGS, out, timeout=DEMO_TIMEOUT_S)
    elapsed = time.monotonic() - started
    (out.parent / "demo.stderr").write_text(proc.stderr)
    assert proc.returncode == 0, (
        f"demo failed ({proc.returncode}) after {elapsed:.0f} s:\n{proc.stdout}\n"
        f"{proc.stderr[-4000:]}"
    )
    return out, proc.stdout


@pytest.fixture(scope="module")
def summary(demo_run: tuple[Path, str]) -> dict[str, Any]:
    return json.loads((demo_run[0] / "summary.json").read_text())


def test_the_screen_shows_tokcaps_progress_only(demo_run: tuple[Path, str]) -> None:
    """No third-party warnings or notes (torch, vLLM, Ray, TransferQueue; in this process
    or in a child) between tokcap's stage lines."""
    lines = [line for line in (demo_run[0].parent / "demo.stderr").read_text().splitlines() if line]
    assert lines
    assert [line for line in lines if not line.startswith("[tokcap]")] == []


def test_counts_add_up(summary: dict[str, Any]) -> None:
    rows, ro = summary["rows"], summary["rollouts"]
    assert rows["valid"] + rows["placeholder"] == rows["total"]
    assert ro["verified"] + ro["poisoned"] == ro["total"] == 2 * 4
    assert rows["verified"] == rows["valid"] > 0
    assert summary["calls"]["total"] == 2 * 4 * 3
    assert (
        summary["tokens"]["generated"] + summary["tokens"]["carried"] == summary["tokens"]["total"]
    )
    assert sum(summary["terminal_selection"].values()) == ro["verified"]
    assert sum(v for k, v in summary["failures"].items()) == ro["poisoned"]


def test_the_pool_read_the_staged_calls_ahead_while_the_close_ran(
    summary: dict[str, Any],
) -> None:
    # The earlier turns were staged long before the close, so some calls were read ahead
    # (all of them when the last turns' staging was done too: 22 of 22 in a quiet run);
    # a call staged after the read-ahead was read with its bundle, and none was missing.
    pool = summary["pool"]
    assert 0 < pool["staging/read_ahead_keys"] <= summary["calls"]["on_chain"]
    assert pool["staging/missing_keys"] == 0


def test_interesting_paths_happened(summary: dict[str, Any]) -> None:
    """Each group has a rewriting harness (a forest), a content witness, a declared terminal."""
    assert summary["terminal_selection"]["content"] == 2
    assert summary["terminal_selection"]["declared"] == 2
    assert summary["breaks"]["total"] >= 2
    # --segments all: each rewritten history contributes an extra row.
    assert summary["rows"]["extra_segments"] >= 2


def test_a_harness_that_keeps_its_history_keeps_every_call_on_one_chain(
    summary: dict[str, Any],
) -> None:
    """Issue #13's bar: only the rewriting harness breaks, and it breaks by cause."""
    kept = [r for r in summary["per_rollout"] if r["behaviour"] != "rewrite"]
    rewritten = [r for r in summary["per_rollout"] if r["behaviour"] == "rewrite"]
    assert kept
    assert rewritten
    for r in kept:
        assert r["status"] == "verified", r
        assert r["on_chain"] == r["calls"], r
        assert r["breaks"] == [], r
    assert summary["breaks"]["template_mismatch"] == 0
    for r in rewritten:
        assert r["breaks"], r
        assert r["on_chain"] < r["calls"], r
    assert summary["breaks"]["total"] == sum(len(r["breaks"]) for r in rewritten)


def test_real_tool_calls_were_made_and_spliced(summary: dict[str, Any]) -> None:
    """Forced calls (two in parallel on each first turn) came back as OpenAI tool_calls; the
    parser's re-serialised JSON is spliced, never a break."""
    assert summary["version"] == 2
    assert summary["calls"]["tool_calls"] >= 2 * 4 * 2
    assert all(r["tool_calls"] >= 2 for r in summary["per_rollout"])
    assert summary["splices"]["tool_call_format"] >= 1
    assert summary["splices"]["total"] == sum(len(r["splices"]) for r in summary["per_rollout"])


def test_the_harness_spoke_responses_and_messages_too(summary: dict[str, Any]) -> None:
    """Group 1's response_id slot plays the openai Responses client, its declared slot the
    anthropic SDK: each a verified rollout of three calls with tool calls, all on one chain
    (and counted by the engine-parity check below, on vLLM's usage lengths)."""
    apis = summary["apis"]
    assert {a: (n["rollouts"], n["calls"]) for a, n in apis.items()} == {
        "chat": (6, 18),
        "responses": (1, 3),
        "messages": (1, 3),
    }
    for r in summary["per_rollout"]:
        if r["api"] != "chat":
            assert (r["status"], r["on_chain"], r["breaks"]) == ("verified", 3, []), r
            assert r["tool_calls"] >= 2, r
    assert apis["responses"]["verified"] == apis["messages"]["verified"] == 1


def test_rows_are_exactly_what_the_engine_reported(summary: dict[str, Any]) -> None:
    parity = summary["engine_parity"]
    assert parity["rows_checked"] == summary["rows"]["valid"]
    assert parity["calls_checked"] == summary["calls"]["on_chain"]
    assert parity["rows_differing"] == 0
    assert parity["max_logprob_abs_diff"] < 1e-6


def test_retokenizing_would_have_drifted(summary: dict[str, Any]) -> None:
    drift = summary["drift"]
    assert drift["trajectories_checked"] >= 1
    assert drift["trajectories_drifted"] >= 1
    drifted = [r for r in summary["per_rollout"] if r["drift_at"] is not None]
    assert drifted
    assert all(r["drift_at"] > 0 for r in drifted)


def test_counts_are_ints_and_drifted_tokens_start_at_the_drift(summary: dict[str, Any]) -> None:
    for bucket in ("failures", "breaks", "splices"):
        assert all(type(v) is int for v in summary[bucket].values()), bucket
    assert '"total": 0.0' not in json.dumps(summary)
    drifted = [r for r in summary["per_rollout"] if r["drift_at"] is not None]
    # tokens from the first drift on: fewer than the drifted rows' whole length
    assert 0 < summary["drift"]["tokens_in_drifted"] < summary["tokens"]["total"]
    assert summary["drift"]["tokens_in_drifted"] >= len(drifted)


def test_advantages_respect_the_valid_mask(summary: dict[str, Any]) -> None:
    assert summary["advantages"]["placeholder_rows_nonzero"] == 0


def test_show_reprints_the_saved_summary(demo_run: tuple[Path, str]) -> None:
    out, printed = demo_run
    shown = tokcap("show", out, timeout=60, check=True)
    for line in ("What was captured", "Checks", "Rollouts", "Timings"):
        assert line in shown.stdout
    assert "rows differing from the engine's own ids" in printed


def _png_stats(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct colours in a 64x64 thumbnail)."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        colours = image.convert("RGB").resize((64, 64)).getcolors(maxcolors=64 * 64) or []
    return width, height, len(colours)


def test_report_renders_in_headless_chromium(demo_run: tuple[Path, str], tmp_path: Path) -> None:
    report = demo_run[0] / "report.html"
    html = report.read_text()
    assert "http://" not in html
    assert "https://" not in html
    shot = tmp_path / "report.png"
    run_chromium(
        tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,1800", report.as_uri()
    )
    assert shot.stat().st_size > 20_000
    width, height, colours = _png_stats(shot)
    assert (width, height) == (1400, 1800)
    assert colours > 20, "the screenshot is (nearly) one colour"


def test_report_picks_any_trajectory_and_shows_plots_in_chromium(
    demo_run: tuple[Path, str], summary: dict[str, Any], tmp_path: Path
) -> None:
    """Loads the page with a trajectory picked (``#tN``, what the picker writes), lets its
    script run, and reads the DOM back: the picked trajectory alone is shown, every valid
    row is reachable, the plots are there, prompts start folded."""
    report = demo_run[0] / "report.html"
    count = report.read_text().count('<section class="traj"')
    assert count == summary["rows"]["valid"]
    picked = f"t{count - 1}"
    dom = dump_dom(f"{report.as_uri()}#{picked}", tmp_path / "profile")
    sections = re.findall(r'<section class="traj" id="(t\d+)"( hidden="")?', dom)
    assert len(sections) == count
    assert [s for s, hidden in sections if not hidden] == [picked]
    assert dom.count('<option value="t') == count
    plots = set(re.findall(r'<svg class="plot" data-plot="(\w+)"', dom))
    assert plots >= {"reward", "advantage", "length", "logprob"}
    assert '<details class="prompt">' in dom
    assert '<details class="prompt" open' not in dom
    assert "re-tokenised" in dom  # the captured ids beside the re-tokenised ones


# ---- Ctrl-C ------------------------------------------------------------------------------


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening_pids() -> set[int]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {int(p) for p in re.findall(r"pid=(\d+)", out)}


def test_ctrl_c_shuts_everything_down(tmp_path: Path) -> None:
    assert shutil.which("ss"), "ss (iproute2) is needed to check listening sockets"
    proc = subprocess.Popen(
        tokcap_command(*DEMO_ARGS, tmp_path / "run"),
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    log: list[str] = []
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    try:
        for line in proc.stdout:
            log.append(line)
            if "[tokcap] rollouts (harness) ..." in line:
                break
            assert time.monotonic() < deadline, "the demo never reached its rollouts"
        else:
            pytest.fail("the demo ended before its rollouts:\n" + "".join(log[-40:]))
        started = _children(proc.pid) | {proc.pid}
        listening = _listening_pids() & started
        assert listening, "the demo should be serving (vLLM, Ray, TQ) by now"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.append(rest)
    assert proc.returncode == 130, "".join(log[-60:])
    time.sleep(2)  # the last Ray processes notice their raylet is gone
    still = {pid for pid in started if _alive(pid)}
    assert not still, f"left running after Ctrl-C: {still}"
    assert not (_listening_pids() & started)
