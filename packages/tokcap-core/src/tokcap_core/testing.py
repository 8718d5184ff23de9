"""Hypothesis strategies and the conformance kit, for tokcap's tests and for users' own.

- strategies: `rollout_ids`, `simulated_rollouts`, `staged_calls`, `manifests`, `entries`;
- the sink kit: `SinkConformance` (subclass it as a pytest ``Test...`` class with an async
  ``make_sink``) or the ``check_*`` functions / `SINK_CHECKS` on any async sink factory;
- the format kit: `check_capture_format` on an implementation's ``(manifest, staged)``
  samples (or, with ``verify=``, another verifier on `golden_samples`; `cli_verifier`
  makes one of a verifier's command line, ``tokcap-core verify`` by default).

Importing this module imports hypothesis (``pip install "tokcap-core[testing]"``);
``import tokcap_core`` alone never does.
"""

from __future__ import annotations

from typing import Any

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        'tokcap_core.testing needs hypothesis: pip install "tokcap-core[testing]"'
    ) from e

from . import _conformance_cli, _conformance_format, _conformance_sink
from ._conformance_cli import *  # noqa: F403
from ._conformance_format import *  # noqa: F403
from ._conformance_sink import *  # noqa: F403
from ._ledger import Entry
from ._manifest import Manifest
from ._staged import StagedCall
from .simulate import SimulatedRollout, simulate_rollout

__all__ = [
    *_conformance_cli.__all__,
    *_conformance_format.__all__,
    *_conformance_sink.__all__,
    "entries",
    "manifests",
    "rollout_ids",
    "simulated_rollouts",
    "staged_calls",
]


def rollout_ids() -> st.SearchStrategy[str]:
    """Valid rollout ids."""
    return st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True)


@st.composite
def simulated_rollouts(
    draw: Any, *, max_turns: int = 6, max_roots: int = 3, routes: bool | None = None
) -> SimulatedRollout:
    """Closed synthetic rollouts: chains, forests, off-chain failures, all terminal modes."""
    return simulate_rollout(
        draw(rollout_ids()),
        seed=draw(st.integers(0, 2**32 - 1)),
        turns=draw(st.integers(1, max_turns)),
        roots=draw(st.integers(1, max_roots)),
        offchain_failures=draw(st.integers(0, 2)),
        terminal=draw(st.sampled_from(["declared", "response_id", "content", "heuristic"])),
        routes=draw(st.booleans()) if routes is None else routes,
        reward=draw(st.one_of(st.none(), st.floats(-10, 10, allow_nan=False))),
        max_delta=draw(st.integers(1, 24)),
    )


@st.composite
def staged_calls(draw: Any, *, routes: bool | None = None) -> StagedCall:
    """One staged call (root or child) taken from a synthetic rollout."""
    rollout = draw(simulated_rollouts(max_turns=4, max_roots=1, routes=routes))
    call: StagedCall = draw(st.sampled_from(rollout.calls))
    return call


def manifests() -> st.SearchStrategy[Manifest]:
    """Manifests of closed synthetic rollouts."""
    return simulated_rollouts().map(lambda r: r.manifest)


def entries() -> st.SearchStrategy[tuple[str, tuple[Entry, ...]]]:
    """``(rollout_id, entries)`` of synthetic ledger histories."""
    return simulated_rollouts().map(lambda r: (r.ledger.rollout_id, r.ledger.entries))
