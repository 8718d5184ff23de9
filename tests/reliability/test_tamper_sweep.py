"""The tamper sweep's CI profile: every single change to a manifest or a staged row is detected.

The full sweep (every byte x 3 replacements, larger rollouts) is ``bench/tamper_sweep.py``;
its figures are in RELIABILITY.md. This profile covers all 24 scenario combinations with small
rollouts and every 16th manifest byte (offset rotated per scenario): ~21k cases, ~8 s on an
idle core.
"""

from __future__ import annotations

import pytest

from tests.reliability.tamper import EQUIVALENT, KINDS, MISS, SweepReport, sweep

CI_MIN_CASES = 2_000


@pytest.fixture(scope="module")
def report() -> SweepReport:
    return sweep(CI_MIN_CASES, small=True, min_scenarios=24, replacements=1, byte_stride=16)


def test_no_tamper_is_missed(report: SweepReport) -> None:
    assert report.misses == []
    assert report.miss_count == 0


def test_the_sweep_reaches_its_target_in_every_kind(report: SweepReport) -> None:
    assert report.cases >= CI_MIN_CASES
    assert report.scenarios >= 24
    for kind in KINDS:
        assert report.kinds[kind].cases > 0, kind


def test_only_manifest_bytes_can_be_equivalent_encodings(report: SweepReport) -> None:
    for kind, stats in report.kinds.items():
        if kind != "manifest_byte":
            assert stats.verdicts[EQUIVALENT] == 0, kind
        assert stats.verdicts[MISS] == 0, kind
