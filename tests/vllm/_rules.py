"""What the engine-free tests of the gate's rules hand a `RolloutBook` instead of anyio's."""

from __future__ import annotations


class Flag:
    """A plain flag standing in for the driver's ``anyio.Event`` (the rules only set it)."""

    def __init__(self) -> None:
        self.count = 0

    def set(self) -> None:
        self.count += 1

    def is_set(self) -> bool:
        return self.count > 0

    async def wait(self) -> None:  # the rules never wait
        raise AssertionError("the rules never wait")


class NoLock:
    """The driver's planning lock, never entered by the rules."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None
