"""The gate's one metrics system: Prometheus collectors in a registry of its own.

Why not vLLM's ``/metrics``: vLLM serves that from the default registry, or from a
fresh multiprocess registry when it runs several API servers, where collectors
registered in this process would silently vanish. A registry per gate is always exact,
never collides with ``vllm:*`` names, and sits behind the control-plane token like the
other control routes (Prometheus scrapes with ``authorization: {credentials: ...}``).

Every counter the gate keeps lives here and nowhere else: the exposition text
(`render`, ``GET /tokcap/v1/metrics``) and the ``dict[str, float]`` view for any logger
(`as_dict`, `Gate.metrics`) are two renderings of the same collectors. Labels are closed
sets (failure buckets, break and splice causes, event kinds, error codes).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokcap_core import Entry, StagedCall
from tokcap_core.ledger import Admitted, Failed, Poisoned, Staged
from tokcap_core.reasons import reason_bucket

from ..persist import GateHooks

__all__ = ["CONTENT_TYPE", "GateMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_PREFIX = "tokcap_"


class GateMetrics(GateHooks):
    """The gate's collectors; ``held()`` returns ``(open, closed)`` rollout counts at scrape."""

    def __init__(self, held: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, labels, registry=r)

        self.admitted = counter("tokcap_calls_admitted", "Captured calls admitted.")
        self.staged = counter("tokcap_calls_staged", "Captured calls committed.")
        self.by_api = counter(
            "tokcap_calls_by_api",
            "Captured calls admitted, by the API the request spoke (chat, completion, "
            "messages, responses).",
            "api",
        )
        self.failed = counter(
            "tokcap_calls_failed",
            "Captured calls failed, by reason bucket and whether a completion was served.",
            "bucket",
            "served",
        )
        self.breaks = counter(
            "tokcap_breaks", "Later calls that started a new root, by cause.", "cause"
        )
        self.splices = counter(
            "tokcap_splices",
            "Calls that kept their parent's exact ids where the template re-renders it, by cause.",
            "cause",
        )
        self.poisoned = counter(
            "tokcap_rollouts_poisoned",
            "Rollouts poisoned by the gate (restart, contained failure), by reason bucket.",
            "bucket",
        )
        self.entries = counter(
            "tokcap_ledger_entries", "Ledger entries appended, by event kind.", "kind"
        )
        self.staged_bytes = counter(
            "tokcap_staged_bytes", "Token, logprob and route bytes the sink acknowledged."
        )
        self.stage_seconds = Histogram(
            "tokcap_stage_seconds",
            "Duration of one staging write to the sink.",
            ["outcome"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.orphan_clears = counter(
            "tokcap_orphan_clears",
            "Staged rows of abandoned calls cleared by the gate, by outcome.",
            "outcome",
        )
        self.contained = counter(
            "tokcap_contained_failures",
            "Failures inside the gate contained to one rollout (it is poisoned), by code.",
            "code",
        )
        self.refused = counter(
            "tokcap_requests_refused",
            "Captured requests refused with an error answer, by code.",
            "code",
        )
        self.ledger_write_failures = counter(
            "tokcap_ledger_write_failures",
            "Ledger-file writes that failed (their rollouts are poisoned).",
        )
        rollouts = Gauge(
            "tokcap_rollouts", "Rollouts the gate holds, by state.", ["state"], registry=r
        )
        rollouts.labels("open").set_function(lambda: float(held()[0]))
        rollouts.labels("closed").set_function(lambda: float(held()[1]))

    # ---- GateHooks ---------------------------------------------------------------------

    def on_entry(self, rollout_id: str, entry: Entry) -> None:
        """Count the entry, and the call or rollout outcome it records."""
        event = entry.event
        self.entries.labels(event.KIND).inc()
        if isinstance(event, Admitted):
            self.admitted.inc()
            if event.break_cause is not None:
                self.breaks.labels(event.break_cause).inc()
            if event.splice_cause is not None:
                self.splices.labels(event.splice_cause).inc()
        elif isinstance(event, Staged):
            self.staged.inc()
        elif isinstance(event, Failed):
            self.failed.labels(reason_bucket(event.reason), str(event.served).lower()).inc()
        elif isinstance(event, Poisoned):
            self.poisoned.labels(reason_bucket(event.reason)).inc()

    def on_sink_write(self, call: StagedCall, seconds: float, error: str | None) -> None:
        """Observe the write's latency; count its bytes once acknowledged."""
        self.stage_seconds.labels("ok" if error is None else "error").observe(seconds)
        if error is None:
            size = memoryview(call.tokens).nbytes + memoryview(call.logprobs).nbytes
            if call.routes is not None:
                size += memoryview(call.routes.data).nbytes
            self.staged_bytes.inc(size)

    # ---- renderings --------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition of every tokcap metric."""
        return generate_latest(self.registry)

    def as_dict(self) -> dict[str, float]:
        """Every counter and gauge as ``{"tokcap/<name>[/<label>...]": value}``.

        Histograms are left to the exposition text (their count is ``tokcap/stage_writes``).
        """
        out: dict[str, float] = {}
        for family in self.registry.collect():
            name = family.name.removeprefix(_PREFIX)
            for sample in family.samples:
                if family.type == "counter" and not sample.name.endswith("_total"):
                    continue  # the *_created timestamps
                if family.type == "histogram":
                    if sample.name.endswith("_count"):
                        key = "/".join(["tokcap/stage_writes", *sample.labels.values()])
                        out[key] = out.get(key, 0.0) + sample.value
                    continue
                key = "/".join([f"tokcap/{name}", *sample.labels.values()])
                out[key] = float(sample.value)
        return dict(sorted(out.items()))
