"""What the gate tells its observers (the ledger file, the Prometheus metrics).

Hooks run on the gate's event loop, inline with the event that fires them, so they must
be cheap and must not raise: an entry is already in the ledger when ``on_entry`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from tokcap_core import Entry, StagedCall

__all__ = ["GateHooks", "make_durable"]


class GateHooks:
    """Base class with no-op methods; override the ones you need and `Gate.attach` it."""

    def on_entry(self, rollout_id: str, entry: Entry) -> None:
        """An entry was appended to ``rollout_id``'s ledger."""

    def on_sink_write(self, call: StagedCall, seconds: float, error: str | None) -> None:
        """One staging write finished (``error`` is None when the sink acknowledged it)."""

    def on_release(self, rollout_id: str) -> None:
        """The gate forgot a rollout: a closed one released, or one none of whose calls was
        served (vLLM refused them)."""

    async def on_close(self, rollout_id: str) -> None:
        """A rollout closed; return once its entries are durable (the close waits for it)."""


async def make_durable(hooks: Sequence[GateHooks], rollout_ids: Sequence[str]) -> None:
    """Tell every hook that ``rollout_ids`` closed and wait until each made them durable:
    the rollouts concurrently (the ledger file's concurrent `on_close` calls share one
    fsync), the hooks in turn; the first error raises once every hook was told."""
    errors: list[Exception] = []

    async def one(hook: GateHooks, rollout_id: str) -> None:
        try:
            await hook.on_close(rollout_id)
        except Exception as e:
            errors.append(e)

    for hook in hooks:
        async with anyio.create_task_group() as tg:
            for rollout_id in rollout_ids:
                tg.start_soon(one, hook, rollout_id)
    if errors:
        raise errors[0]
