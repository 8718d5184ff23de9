"""Ray pool tests: one Ray per session, shared with the TransferQueue tests.

``tq_cluster`` (tests/conftest.py) owns the session's Ray (loopback, ``extra_cpus=2``
for the pool's actors); these tests never ``ray.init`` or ``ray.shutdown`` themselves.
The test sinks in ``tests.ray.support`` are pickled by value: a Ray worker must not
import ``tests`` (transferqueue installs a stray ``tests`` package in site-packages).
"""

from __future__ import annotations

from typing import Any

import pytest
import ray
import ray.cloudpickle

import tests.ray.support

ray.cloudpickle.register_pickle_by_value(tests.ray.support)


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> Any:
    """The session's Ray (started by ``tq_cluster``); returns the TQ cluster handle."""
    cluster = request.getfixturevalue("tq_cluster")
    assert ray.is_initialized()
    return cluster


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Ray's ObjectRefs are awaited natively on asyncio."""
    return "asyncio"
