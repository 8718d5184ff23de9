"""Hypothesis profiles for the reliability suite (issue #9).

- ``ci`` (default): short; the whole fuzz file runs in well under 40 s.
- ``slow``: >= 100k inputs across the decoders (10k per fuzz test), for a soak run::

      HYPOTHESIS_PROFILE=slow .venv/bin/python -m pytest -q -m slow tests/reliability \
          --hypothesis-show-statistics

The profiles are applied per test (``settings(fuzz_settings())``), never loaded globally,
so the rest of the suite keeps hypothesis's defaults.
"""

from __future__ import annotations

import os
from datetime import timedelta

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_COMMON = {
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    # A single input that takes seconds is a hang in the making: fail it, don't wait it out.
    "deadline": timedelta(seconds=2),
    "database": None,
    "derandomize": False,
}
settings.register_profile("ci", max_examples=120, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("slow", max_examples=10_000, **_COMMON)  # type: ignore[arg-type]
if PROFILE not in ("ci", "slow"):
    raise RuntimeError(f"HYPOTHESIS_PROFILE must be 'ci' or 'slow', not {PROFILE!r}")


def fuzz_settings() -> settings:
    """The active profile's settings (``HYPOTHESIS_PROFILE``, default ``ci``)."""
    return settings.get_profile(PROFILE)


FUZZ_TIMEOUT_S = 120 if PROFILE == "ci" else 3600
"""pytest-timeout per fuzz test: a hang fails the test instead of stalling the run."""
