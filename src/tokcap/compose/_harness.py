"""Letting a black-box harness play rollouts through a gate, a bounded number at a time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import anyio
import openai

from ._stack import GateEndpoint

__all__ = ["Rollout", "play_rollouts"]


class Rollout(Protocol):
    """Anything a harness plays that knows its rollout id."""

    @property
    def rollout_id(self) -> str:
        """The rollout's id (its calls go to the gate under it)."""
        ...


R = TypeVar("R", bound=Rollout)


async def play_rollouts(
    gate: GateEndpoint,
    rollouts: Sequence[R],
    play: Callable[[openai.AsyncOpenAI, str, R, int], Awaitable[object]],
    *,
    concurrency: int,
    done: Callable[[], object] | None = None,
) -> None:
    """``await play(client, model, rollout, n)`` for the n-th of ``rollouts``, at most
    ``concurrency`` at a time, each with its own OpenAI client on the rollout's URL
    (``gate.rollout_url``, no retries); ``done()`` after each one."""
    limit = anyio.Semaphore(concurrency)

    async def one(rollout: R, n: int) -> None:
        async with (
            limit,
            openai.AsyncOpenAI(
                base_url=gate.rollout_url(rollout.rollout_id), api_key="unused", max_retries=0
            ) as client,
        ):
            await play(client, gate.model, rollout, n)
        if done is not None:
            done()

    async with anyio.create_task_group() as tg:
        for n, rollout in enumerate(rollouts):
            tg.start_soon(one, rollout, n)
