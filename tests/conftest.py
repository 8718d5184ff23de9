"""Suite-wide pytest set-up.

transferqueue installs a stray top-level ``tests`` package into site-packages. Our test modules
import shared helpers as ``from tests.<helper> import ...``; pyproject's ``pythonpath = ["."]``
puts the repo root first on ``sys.path`` so that ``tests`` is this folder. Fail loudly if not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

import tests

_HERE = Path(__file__).resolve().parent
if Path(tests.__file__).resolve().parent != _HERE:
    raise RuntimeError(
        f"`import tests` resolved to {tests.__file__}, not {_HERE}: run pytest from the repo "
        "root (bash scripts/test.sh) so the repo's tests/ package shadows site-packages."
    )

# `pytest --hypothesis-profile=lean`: fewer examples where a test does not pin its own count
# (tests/test_python_versions.py runs the core's tests this way on each extra Python).
settings.register_profile("lean", max_examples=10, deadline=None)
# No per-example deadline: a deadline is a timed assertion, and it fails on a loaded box
# (hypothesis's 200 ms default did, on the core's advantage laws, with 4 engines running).
settings.register_profile("tokcap", deadline=None)
settings.load_profile("tokcap")

# Ray must not re-run `uv run` in its workers (see scripts/setup.sh).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# TQ reads this when imported; its default logs a warning on every op on a 2-core box.
os.environ.setdefault("TQ_NUM_THREADS", "2")


# ---- TransferQueue on a local Ray, shared by the whole session ---------------------------


@pytest.fixture(scope="session")
def tq_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One loopback-only local Ray + TransferQueue for the session (≈30 s to start).

    ``extra_cpus=2`` leaves room for other actors on the same Ray (a reassembler pool).
    Yields `tokcap_tq.LocalTQ`; TQ is closed before Ray at the end of the session.
    """
    from tokcap_tq import local_tq

    with local_tq(tmp_path_factory.mktemp("tq"), storage_units=1, extra_cpus=2) as cluster:
        yield cluster


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``replaces_tq`` run last, in their order: they close the session's
    TransferQueue and start another, which no test collected after them should meet."""
    last = [item for item in items if item.get_closest_marker("replaces_tq")]
    if last:
        marked = set(map(id, last))
        items[:] = [item for item in items if id(item) not in marked] + last
