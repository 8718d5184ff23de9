"""What the gate tells its observers (the ledger file, the Prometheus metrics).

Hooks run on the gate's event loop, inline with the event that fires them, so they must
be cheap and must not raise: an entry is already in the ledger when ``on_entry`` runs.
"""

from __future__ import annotations

from tokcap_core import Entry, StagedCall

__all__ = ["GateHooks"]


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
