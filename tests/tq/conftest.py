"""TransferQueue tests: anyio on asyncio (TQ's async API is asyncio-only)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """TQ's native coroutines need asyncio."""
    return "asyncio"
