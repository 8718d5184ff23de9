"""What tokcap_vllm's HTTP clients share: the bearer-token pool, ``async with``, fan-out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Self, TypeVar

import anyio
import httpx

__all__ = ["AsyncClosing", "bearer_http", "each_concurrently"]

KEEPALIVE_S = 2.0
"""Seconds a control-plane client keeps an idle connection (under the gate's 5 s)."""

_T = TypeVar("_T")
_R = TypeVar("_R")


def bearer_http(
    base_url: str, token: str, timeout_s: float, transport: httpx.AsyncBaseTransport | None
) -> httpx.AsyncClient:
    """A connection pool that sends ``token`` in the ``authorization`` header only.

    Idle connections are dropped after `KEEPALIVE_S`, before a gate drops them (vLLM's
    server keeps them 5 s by default): a request sent on a connection the server is
    closing is reset, and a reset close or release would be taken for a dead gate.
    """
    return httpx.AsyncClient(
        base_url=base_url,
        headers={"authorization": f"Bearer {token}"},
        timeout=timeout_s,
        transport=transport,
        limits=httpx.Limits(
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S
        ),  # httpx's defaults but the expiry
    )


class AsyncClosing:
    """``async with`` for a client: entering gives the client, leaving awaits its `aclose`."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client's connections."""
        raise NotImplementedError


async def each_concurrently(items: Sequence[_T], call: Callable[[_T], Awaitable[_R]]) -> list[_R]:
    """``call`` on every item at once, in one task group; the answers in the items' order."""
    results: list[_R | None] = [None] * len(items)

    async def one(i: int) -> None:
        results[i] = await call(items[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]
