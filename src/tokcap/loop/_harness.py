"""The loop's black-box harness on a run's gates, and what its scorer hands the trainer.

`Harness.play` plays episodes of the task (`tokcap.loop._task.play_digits`, the real
``openai`` client) through the run's gates, ``concurrency`` at a time, on one HTTP client
(`harness_on` opens it); on served gates every rollout is opened through the fleet first
(its URL is then its gate's). `finished` is one played episode as the trainer collects it
(`tokcap.compose.Finished`: its reward and the scorer's witness).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import openai

from tokcap_vllm import GateFleet

from ..compose import Finished, Run, Stack, play_rollouts
from ._config import LoopConfig
from ._meters import BusyMeter
from ._task import DigitsEpisode, play_digits

__all__ = ["HARNESS_KEEPALIVE_S", "Harness", "finished", "harness_on"]

HARNESS_KEEPALIVE_S = 2.0
"""How long the harness keeps an idle connection to a gate: shorter than the gate's own
keep-alive (vLLM's default 5 s), so it never sends a call on a connection the gate is
closing (a reset, taken for a dead gate)."""


@dataclass(frozen=True, slots=True)
class Harness:
    """The harness of ``config``'s task on a run's gates (``fleet``: served gates), counting
    its calls in flight on ``busy``, every client on ``http``."""

    config: LoopConfig
    stack: Stack
    fleet: GateFleet | None
    busy: BusyMeter
    http: openai.DefaultAsyncHttpxClient

    async def play(
        self,
        episodes: list[DigitsEpisode],
        index: int,
        *,
        played: Callable[[DigitsEpisode, float], None] | None = None,
    ) -> None:
        """Play ``episodes``; ``index`` (step or group) seeds them.

        A ``declared`` rollout's terminal call (its last answer) is declared by its close
        (`finished`: the close's ``terminal_response_id``), not by a request of its own
        after its last answer. ``played(episode, answered)`` is called once each rollout is
        done (also when it failed), ``answered`` being when its last answer came back.
        """
        config = self.config

        async def one(
            client: openai.AsyncOpenAI, model: str, episode: DigitsEpisode, n: int
        ) -> None:
            seed = (config.seed * 10_000 + index) * 1_000 + n
            answered = time.perf_counter()
            try:
                self.busy.enter()
                try:
                    await play_digits(
                        client,
                        model,
                        episode,
                        turns=config.turns,
                        max_tokens=config.max_tokens,
                        seed=seed,
                        task=config.task,
                        api=config.harness_api,
                    )
                finally:
                    self.busy.leave()
                answered = time.perf_counter()
            finally:
                if played is not None:
                    played(episode, answered)

        if self.fleet is not None:  # before playing: a rollout's URL is its gate's, set at open
            for episode in episodes:
                await self.fleet.open(episode.rollout_id)
        await play_rollouts(
            self.stack.gate, episodes, one, concurrency=config.concurrency, http_client=self.http
        )


@contextlib.asynccontextmanager
async def harness_on(config: LoopConfig, run: Run, busy: BusyMeter) -> AsyncIterator[Harness]:
    """The `Harness` on ``run``'s gates, with its shared HTTP client open: openai's
    defaults, idle connections kept `HARNESS_KEEPALIVE_S`."""
    limits = openai.DEFAULT_CONNECTION_LIMITS
    async with openai.DefaultAsyncHttpxClient(
        limits=type(limits)(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=HARNESS_KEEPALIVE_S,
        )
    ) as http:
        yield Harness(config, run.stack, run.fleet, busy, http)


def finished(e: DigitsEpisode) -> Finished:
    """What the scorer hands over for ``e``: its reward and witness, or, for a ``declared``
    rollout, its last answer declared as its terminal call by the close. A rollout whose
    gate was lost mid-play has no answer: it closes without a witness (its receipt is
    poisoned ``gate_unreachable``) and trains no row."""
    return Finished(
        rollout_id=e.rollout_id,
        group_id=e.group_id,
        reward=e.reward,
        response_id=_last(e.response_ids) if e.scored == "response_id" else None,
        content=_last(e.contents) if e.scored == "content" else None,
        terminal_response_id=_last(e.response_ids) if e.witness == "declared" else None,
    )


def _last(answers: list[str]) -> str | None:
    return answers[-1] if answers else None
