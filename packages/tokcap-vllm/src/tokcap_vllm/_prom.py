"""Prometheus metrics of one gate, in its own registry, served at ``/tokcap/v1/metrics``.

Why not vLLM's ``/metrics``: vLLM serves that from the default registry, or from a
fresh multiprocess registry when it runs several API servers, where collectors
registered in this process would silently vanish. A registry per gate is always exact,
never collides with ``vllm:*`` names, and sits behind the control-plane token like the
other control routes (Prometheus scrapes with ``authorization: {credentials: ...}``).

Counters are fed by the gate's hooks from ledger entries (labels are closed sets:
failure buckets, break causes, event kinds); gauges are read from the gate at scrape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokcap_core import Entry, StagedCall
from tokcap_core.ledger import Admitted, Failed
from tokcap_core.reasons import reason_bucket

from ._hooks import GateHooks

if TYPE_CHECKING:
    from ._gate import Gate

__all__ = ["CONTENT_TYPE", "GateMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class GateMetrics(GateHooks):
    """The gate's Prometheus collectors (`Gate.attach` it; `render` for the exposition text)."""

    def __init__(self, gate: Gate) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.admitted = Counter("tokcap_calls_admitted", "Captured calls admitted.", registry=r)
        self.staged = Counter("tokcap_calls_staged", "Captured calls committed.", registry=r)
        self.failed = Counter(
            "tokcap_calls_failed",
            "Captured calls failed, by reason bucket and whether a completion was served.",
            ["bucket", "served"],
            registry=r,
        )
        self.breaks = Counter(
            "tokcap_breaks", "Later calls that started a new root, by cause.", ["cause"], registry=r
        )
        self.entries = Counter(
            "tokcap_ledger_entries", "Ledger entries appended, by event kind.", ["kind"], registry=r
        )
        self.staged_bytes = Counter(
            "tokcap_staged_bytes",
            "Token, logprob and route bytes the sink acknowledged.",
            registry=r,
        )
        self.stage_seconds = Histogram(
            "tokcap_stage_seconds",
            "Duration of one staging write to the sink.",
            ["outcome"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        held = Gauge("tokcap_rollouts", "Rollouts the gate holds, by state.", ["state"], registry=r)
        held.labels("open").set_function(lambda: _count(gate, "open"))
        held.labels("closed").set_function(lambda: _count(gate, "closed"))

    def on_entry(self, rollout_id: str, entry: Entry) -> None:
        """Count the entry, and the call outcome it records."""
        event = entry.event
        self.entries.labels(event.KIND).inc()
        if isinstance(event, Admitted):
            self.admitted.inc()
            if event.break_cause is not None:
                self.breaks.labels(event.break_cause).inc()
        elif isinstance(event, Failed):
            self.failed.labels(reason_bucket(event.reason), str(event.served).lower()).inc()
        elif event.KIND == "staged":
            self.staged.inc()

    def on_sink_write(self, call: StagedCall, seconds: float, error: str | None) -> None:
        """Observe the write's latency; count its bytes once acknowledged."""
        self.stage_seconds.labels("ok" if error is None else "error").observe(seconds)
        if error is None:
            size = memoryview(call.tokens).nbytes + memoryview(call.logprobs).nbytes
            if call.routes is not None:
                size += memoryview(call.routes.data).nbytes
            self.staged_bytes.inc(size)

    def render(self) -> bytes:
        """The Prometheus text exposition of every tokcap metric."""
        return generate_latest(self.registry)


def _count(gate: Gate, state: str) -> float:
    return float(sum(1 for s in gate.rollouts().values() if s == state))
