"""The e2e tests' shared served-gate fleet (`tests.e2e._fleet.SharedFleet`).

``served_fleet`` (session scope) is the one fleet; it rides on the session's Ray +
TransferQueue (``tq_cluster``, tests/conftest.py). Two hooks keep it cheap and safe:

- collection moves every e2e module that uses the fleet next to the first one (each
  module whole, in its own order), so the gates start once;
- after the last test that uses the fleet (when the next test does not), its gates are
  stopped, so they do not hold memory while later modules start engines of their own.
  A test that needs them again later (another order, ``-k``) starts them again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e._fleet import SharedFleet

FLEET = "served_fleet"
_KEY = pytest.StashKey[SharedFleet]()


@pytest.fixture(scope="session")
def served_fleet(
    request: pytest.FixtureRequest, tq_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedFleet]:
    """Two ``tokcap-vllm serve`` gates on the session's Ray + TransferQueue (see
    `SharedFleet`): call ``up()`` for the live gates."""
    import ray

    fleet = SharedFleet(ray.get_runtime_context().gcs_address, tmp_path_factory.mktemp("fleet"))
    request.config.stash[_KEY] = fleet
    try:
        yield fleet
    finally:
        fleet.stop()


def _uses_fleet(item: pytest.Item | None) -> bool:
    return item is not None and FLEET in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules using the fleet run one after another, where the first of them was."""
    users = {getattr(item, "module", None) for item in items if _uses_fleet(item)}
    moved = [item for item in items if getattr(item, "module", None) in users]
    if not moved:
        return
    first = items.index(moved[0])
    rest = [item for item in items if getattr(item, "module", None) not in users]
    items[:] = [*rest[:first], *moved, *rest[first:]]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the fleet's gates once the next test does not use them."""
    fleet = item.config.stash.get(_KEY, None)
    if fleet is not None and _uses_fleet(item) and not _uses_fleet(nextitem):
        fleet.stop()
