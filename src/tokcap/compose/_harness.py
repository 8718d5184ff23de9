"""Letting a black-box harness play rollouts through a gate, a bounded number at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import anyio
import openai

from ._served import FleetEndpoint
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
    http_client: openai.DefaultAsyncHttpxClient | None = None,
) -> None:
    """``await play(client, model, rollout, n)`` for the n-th of ``rollouts``, at most
    ``concurrency`` at a time, each with its own OpenAI client on the rollout's URL
    (``gate.rollout_url``, no retries); ``done()`` after each one.

    On a `FleetEndpoint`, a play that fails in transport (``openai.APIConnectionError``)
    because its gate stopped answering is let go: the fleet marks that gate lost and
    poisons its open rollouts (``gate_unreachable``); the other rollouts play on. A
    transport failure on a gate that still answers is raised.

    The clients share one HTTP connection pool: ``http_client`` (the caller's, left open),
    else one made for this call (``openai.DefaultAsyncHttpxClient``). Building one loads the
    TLS trust store, 90 ms on a loaded 2-core box, on the event loop: one per rollout
    stalled the loop for seconds a step.
    """
    limit = anyio.Semaphore(concurrency)

    async def one(http: openai.DefaultAsyncHttpxClient, rollout: R, n: int) -> None:
        client = openai.AsyncOpenAI(
            base_url=gate.rollout_url(rollout.rollout_id),
            api_key="unused",
            max_retries=0,
            http_client=http,
        )
        async with limit:
            try:
                await play(client, gate.model, rollout, n)
            except openai.APIConnectionError:
                if not isinstance(gate, FleetEndpoint):
                    raise
                fleet = gate.fleet
                if await fleet.probe(fleet.gate_url(rollout.rollout_id)):
                    raise
        if done is not None:
            done()

    async with contextlib.AsyncExitStack() as own:
        if http_client is None:
            http_client = openai.DefaultAsyncHttpxClient()
            own.push_async_callback(http_client.aclose)
        async with anyio.create_task_group() as tg:
            for n, rollout in enumerate(rollouts):
                tg.start_soon(one, http_client, rollout, n)
