"""``tokcap demo``: build the tiny model, run the pipeline, check the rows, save and print.

The process is prepared by `tokcap._startup.start_up` before this module is imported
(``tokcap demo`` calls it first: the CPU engine's environment defaults, quiet loggers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from .._startup import RunOptions, interruptible, save_and_print, use_driver_threads

__all__ = ["DemoOptions", "run_demo"]

QUICK = {"groups": 2, "rollouts": 4, "turns": 3, "max_tokens": 16}
FULL = {"groups": 4, "rollouts": 6, "turns": 4, "max_tokens": 24}


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions(RunOptions):
    """The ``tokcap demo`` flags (None: the quick or full default)."""

    groups: int | None = None
    rollouts: int | None = None
    turns: int | None = None
    max_tokens: int | None = None
    segments: str = "terminal"
    quick: bool = False
    model_family: str = "qwen"


def run_demo(options: DemoOptions, console: Console | None = None) -> int:
    """Run the demo; 0 when every check holds, 1 when one fails, 130 on Ctrl-C."""
    from ._summary import summary_console

    console = console or summary_console()
    err = Console(stderr=True)
    defaults = QUICK if options.quick else FULL
    pick = {k: getattr(options, k) or v for k, v in defaults.items()}
    out = options.run_dir()
    return interruptible(lambda: _run(options, pick, out, console, err), "the demo")


def _run(
    options: DemoOptions, pick: dict[str, int], out: Path, console: Console, err: Console
) -> int:
    from .._stages import Stages

    use_driver_threads()  # this process's torch on every core; the engine core one fewer
    with Stages(err) as stages:
        with stages.stage(f"build tiny {options.model_family} model (cached)"):
            from ._families import model_family

            family = model_family(options.model_family, options.cache)
            from ._pipeline import DemoConfig, run_pipeline

        config = DemoConfig(
            model=family.model,
            groups=pick["groups"],
            rollouts=pick["rollouts"],
            turns=pick["turns"],
            max_tokens=pick["max_tokens"],
            segments=options.segments,
            family=family.name,
            **options.placement(),
        )
        run = run_pipeline(
            config,
            stages,
            vllm_args=family.vllm_args,
            force_tools=family.force_tools,
            tools_every_turn=family.tools_every_turn,
            images=family.images,
        )
        with stages.stage("checks, summary, report"):
            from ._checks import check_rows
            from ._report import render_report
            from ._summary import build_summary

            tokenizer = family.load_tokenizer()
            episodes = {e.rollout_id: e for e in run.episodes}
            parity, drift = check_rows(
                run.rows, episodes, run.manifests, tokenizer, family.retokenize
            )
            summary = build_summary(run, parity, drift, stages.timings_s)
            samples = _samples(run, drift)
            out.mkdir(parents=True, exist_ok=True)
            from ._images import sha256

            sent = {sha256(image): image for e in run.episodes for image in e.images}
            page = render_report(summary, samples, tokenizer, sent)
            (out / "report.html").write_text(page, encoding="utf-8")
    from ._summary import print_summary

    problems = summary_problems(summary)
    return save_and_print(summary, out, stages.timings_s, console, print_summary, problems)


def summary_problems(summary: dict[str, Any]) -> list[str]:
    """The demo's invariants, as messages for each one that does not hold."""
    rows, par = summary["rows"], summary["engine_parity"]
    problems = []
    if rows["valid"] + rows["placeholder"] != rows["total"]:
        problems.append("valid + placeholder rows != total rows")
    if rows["verified"] != rows["valid"]:
        problems.append("a valid row does not match its receipt chain")
    if par["rows_differing"]:
        problems.append(f"{par['rows_differing']} rows differ from the engine's own ids")
    if summary["advantages"]["placeholder_rows_nonzero"]:
        problems.append("a placeholder row got a non-zero advantage")
    images = summary.get("images")
    if images and images["named_by_their_ledgers"] != images["sent_in_verified_rollouts"]:
        problems.append("an image the harness sent is not named by its rollout's ledger")
    for gate in summary.get("gates", []):
        if gate["rollouts"] == 0:
            problems.append(f"gate {gate['url']} served no rollout")
    return problems


def _samples(run: Any, drift: list[Any]) -> list[Any]:
    """Every valid row for the report, by group then rollout; drifted rows carry their drift."""
    drift_of = {d.rollout_id: d for d in drift}
    group_of = {e.rollout_id: e.group for e in run.episodes}
    rows = sorted(
        (r for r in run.rows if r.sample_mask),
        key=lambda r: (group_of.get(r.rollout_id, 0), r.rollout_id, r.segment),
    )
    return [
        (
            row,
            run.receipts[row.rollout_id],
            drift_of.get(row.rollout_id) if row.segment == 0 else None,
        )
        for row in rows
    ]
