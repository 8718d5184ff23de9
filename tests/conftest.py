"""Suite-wide pytest set-up.

transferqueue installs a stray top-level ``tests`` package into site-packages. Our test modules
import shared helpers as ``from tests.<helper> import ...``; pyproject's ``pythonpath = ["."]``
puts the repo root first on ``sys.path`` so that ``tests`` is this folder. Fail loudly if not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

import tests

if TYPE_CHECKING:  # the core's own runs on other Pythons have no tokcap adapters installed
    from tests.e2e._fleet import SharedFleet

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


# ---- the served-gate fleet, shared by the modules that drive gates others started --------
#
# ``served_fleet`` (session scope) is the one fleet; it rides on the session's Ray +
# TransferQueue. Two hooks keep it cheap and safe:
#
# - collection moves every module that uses the fleet next to the first one (each module
#   whole, in its own order), so the gates start once; tests marked
#   ``needs_an_unpushed_fleet`` go before its other users (they train from version 0, which
#   no other user's push may have passed), tests marked ``kills_a_fleet_gate`` after them
#   (so no later test waits for the dead gate to start again);
# - after the last test that uses the fleet (when the next test does not), its gates are
#   stopped, so they do not hold memory while later modules start engines of their own.
#   A test that needs them again later (another order, ``-k``) starts them again.

FLEET = "served_fleet"
_FLEET_KEY = pytest.StashKey["SharedFleet"]()


@pytest.fixture(scope="session")
def served_fleet(
    request: pytest.FixtureRequest, tq_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedFleet]:
    """Two ``tokcap-vllm serve`` gates on the session's Ray + TransferQueue (see
    `tests.e2e._fleet.SharedFleet`): call ``up()`` for the live gates."""
    import ray

    from tests.e2e._fleet import SharedFleet

    fleet = SharedFleet(ray.get_runtime_context().gcs_address, tmp_path_factory.mktemp("fleet"))
    request.config.stash[_FLEET_KEY] = fleet
    try:
        yield fleet
    finally:
        fleet.stop()


def _uses_fleet(item: pytest.Item | None) -> bool:
    return item is not None and FLEET in getattr(item, "fixturenames", ())


def _fleet_users_together(items: list[pytest.Item]) -> None:
    """Modules using the fleet run one after another, where the first of them was; tests
    that need it unpushed run first, tests that kill a gate of it last."""
    users = {getattr(item, "module", None) for item in items if _uses_fleet(item)}
    moved = [item for item in items if getattr(item, "module", None) in users]
    if not moved:
        return
    first = items.index(moved[0])
    rest = [item for item in items if getattr(item, "module", None) not in users]

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("needs_an_unpushed_fleet"):
            return 0
        return 2 if item.get_closest_marker("kills_a_fleet_gate") else 1

    items[:] = [*rest[:first], *sorted(moved, key=rank), *rest[first:]]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the fleet's gates once the next test does not use them."""
    fleet = item.config.stash.get(_FLEET_KEY, None)
    if fleet is not None and _uses_fleet(item) and not _uses_fleet(nextitem):
        fleet.stop()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fleet's users run together (`_fleet_users_together`). Tests marked
    ``replaces_tq`` run last, in their order: they close the session's TransferQueue and
    start another, which no test collected after them should meet."""
    _fleet_users_together(items)
    last = [item for item in items if item.get_closest_marker("replaces_tq")]
    if last:
        marked = set(map(id, last))
        items[:] = [item for item in items if id(item) not in marked] + last
