"""Tamper sweep (issue #9): every single change to a manifest or a staged row must be detected.

    .venv/bin/python bench/tamper_sweep.py            # full: 24 scenarios, every byte x 3
    .venv/bin/python bench/tamper_sweep.py --quick    # the CI profile (small rollouts, 1/16 bytes)
    .venv/bin/python bench/tamper_sweep.py --cases 200000

Scenarios cycle over terminal mode x routes on/off x (roots, off-chain failures); the cases
and the detection rule live in ``tests/reliability/tamper.py``. Prints, per case kind: cases,
detected (of which refused by the `StagedCall` constructor), equivalent encodings, misses and
the top error codes, then throughput. Exits 1 on any miss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # our tests/ package, not transferqueue's stray one

from tests.reliability.tamper import (  # noqa: E402
    DETECTED,
    EQUIVALENT,
    MISS,
    REFUSED,
    SweepReport,
    sweep,
)


def _progress(report: SweepReport) -> None:
    print(
        f"  scenario {report.scenarios:3d}: {report.cases:9,d} cases, "
        f"{report.miss_count} misses, {report.seconds:6.1f} s",
        file=sys.stderr,
        flush=True,
    )


def print_report(report: SweepReport, *, top: int = 4) -> None:
    header = (
        f"{'kind':26s} {'cases':>9s} {'detected':>9s} {'(refused)':>9s} {'equiv':>6s} "
        f"{'misses':>6s}  top codes"
    )
    print(header)
    print("-" * len(header))
    for kind, stats in report.kinds.items():
        v = stats.verdicts
        codes = ", ".join(f"{c} {n}" for c, n in stats.codes.most_common(top))
        print(
            f"{kind:26s} {stats.cases:9,d} {v[DETECTED] + v[REFUSED]:9,d} {v[REFUSED]:9,d} "
            f"{v[EQUIVALENT]:6,d} {v[MISS]:6,d}  {codes}"
        )
    total = report.cases
    tampers = total - sum(s.verdicts[EQUIVALENT] for s in report.kinds.values())
    detected = tampers - report.miss_count
    print("-" * len(header))
    print(
        f"{'total':26s} {total:9,d}   detection {detected:,d}/{tampers:,d} "
        f"({100 * detected / max(tampers, 1):.3f} %), {report.scenarios} scenarios, "
        f"{report.seconds:.1f} s, {total / max(report.seconds, 1e-9):,.0f} cases/s"
    )
    for label, detail in report.misses[:20]:
        print(f"MISS {label}: {detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=10_000, help="minimum number of cases")
    parser.add_argument("--scenarios", type=int, default=24, help="minimum number of scenarios")
    parser.add_argument("--quick", action="store_true", help="the CI profile")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        options = {"small": True, "replacements": 1, "byte_stride": 16}
    else:
        options = {"small": False, "replacements": 3, "byte_stride": 1}
    print(f"tamper sweep: >= {args.cases:,d} cases, >= {args.scenarios} scenarios, {options}")
    report = sweep(
        args.cases, min_scenarios=args.scenarios, seed=args.seed, progress=_progress, **options
    )
    print_report(report)
    return 1 if report.miss_count else 0


if __name__ == "__main__":
    raise SystemExit(main())
