"""Deterministic synthetic rollouts: ledgers and staged calls as a real gate would write them.

Pure given its arguments (a ``seed`` drives a private `random.Random`); used by the
hypothesis strategies in `tokcap_core.testing`, the golden vectors, the shipped
example, the benchmarks and the tamper sweeps.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ._events import SPLICE_CAUSES, Admitted, Closed, Failed, Staged, TerminalDeclared, Witnesses
from ._ledger import Ledger
from ._manifest import Manifest, manifest_of
from ._media import MediaItem
from ._reassembly import reassemble
from ._receipt import assemble_receipt
from ._rows import TrainingRow
from ._staged import StagedCall
from .provenance import Spans, VersionSpan, single_span
from .routes import Routes, routes_from_rows

__all__ = ["SimulatedRollout", "admit_call", "one_call_row", "simulate_rollout", "stage_call"]

TerminalMode = Literal["declared", "response_id", "content", "heuristic"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatedRollout:
    """A closed synthetic rollout: its ledger, manifest and staged calls by staging key."""

    ledger: Ledger
    manifest: Manifest
    staged: dict[str, StagedCall]

    @property
    def calls(self) -> list[StagedCall]:
        """The staged calls in admission order."""
        return list(self.staged.values())


def simulate_rollout(
    rollout_id: str,
    *,
    seed: int,
    turns: int = 4,
    roots: int = 1,
    offchain_failures: int = 0,
    terminal: TerminalMode = "declared",
    routes: bool = False,
    reward: float | None = 1.0,
    max_delta: int = 24,
    vocab: int = 2048,
    start_ns: int = 1_700_000_000_000_000_000,
) -> SimulatedRollout:
    """Simulate ``roots`` conversation chains of ``turns`` calls each (later roots are breaks).

    ``offchain_failures`` adds calls that failed before serving (they must not poison);
    ``terminal`` picks how the terminal is named at close; ``routes`` adds MoE routes
    (2 layers, top-2, 8 experts) in the engine's ``[tokens-1]`` shape. About a third of
    the children are splices (with a cause from `SPLICE_CAUSES`) and about one call in
    five spans a weight push (two ``weight_versions`` spans; half of those kept their KV,
    leaving stale-KV tokens).
    """
    rng = random.Random(seed)
    ledger = Ledger(rollout_id)
    staged: dict[str, StagedCall] = {}
    clock = start_ns
    last: StagedCall | None = None
    failures_left = offchain_failures
    for root in range(roots):
        parent: StagedCall | None = None
        history: list[int] = []
        for _ in range(turns):
            if failures_left and rng.random() < 0.5:
                failures_left -= 1
                clock += 1000
                call_id = ledger.next_call_id()
                ledger.append(_admit(call_id, parent, clock, rng, root))
                ledger.append(Failed(call_id=call_id, reason="engine_failed:aborted", served=False))
            clock += 1000
            call_id = ledger.next_call_id()
            ledger.append(_admit(call_id, parent, clock, rng, root))
            carry = [
                rng.randrange(vocab) for _ in range(rng.randint(0 if parent else 1, max_delta))
            ]
            output = [rng.randrange(vocab) for _ in range(rng.randint(1, max_delta))]
            prompt = history + carry
            version = rng.randint(0, 2)
            spans = single_span(version, len(output))
            if len(output) > 1 and rng.random() < 0.2:  # a push while the call generated
                cut = rng.randint(1, len(output) - 1)
                spans = (
                    VersionSpan(version=version, start=0, end=cut),
                    VersionSpan(version=version + 1, start=cut, end=len(output)),
                )
            # half the pushes keep the call's KV: its later tokens sit on the first version's
            kv = single_span(version, len(output)) if rng.random() < 0.5 else spans
            call = stage_call(
                ledger,
                call_id,
                parent,
                prompt_ids=prompt,
                output_ids=output,
                logprobs=[-rng.random() * 4 for _ in output],
                finish_reason="length" if rng.random() < 0.1 else "stop",
                weight_version=version,
                weight_versions=spans,
                kv_versions=kv,
                routes=_routes(rng, len(prompt) + len(output) - 1) if routes else None,
                response_id=f"resp-{rollout_id}-{call_id}",
                output_fingerprint=lambda digest: f"out-{digest[:16]}",
            )
            staged[call.key] = call
            history = prompt + output
            parent = last = call
    while failures_left:
        failures_left -= 1
        call_id = ledger.next_call_id()
        ledger.append(_admit(call_id, last, clock, rng, roots))
        ledger.append(Failed(call_id=call_id, reason="engine_failed:aborted", served=False))
    if last is not None and terminal == "declared":
        ledger.append(TerminalDeclared(by="call_id", value=last.call_id))
    witnesses = Witnesses()
    if last is not None and terminal == "response_id":
        witnesses = Witnesses(response_id=f"resp-{rollout_id}-{last.call_id}")
    elif last is not None and terminal == "content":
        witnesses = Witnesses(content_fingerprint=f"out-{last.digest[:16]}")
    ledger.append(Closed(reward=reward, witnesses=witnesses))
    return SimulatedRollout(ledger=ledger, manifest=manifest_of(ledger), staged=staged)


def admit_call(
    ledger: Ledger, parent: StagedCall | None, *, admitted_at: int, request_fingerprint: str
) -> str:
    """Append the ``Admitted`` of a new call that extends ``parent`` (a root when None)."""
    call_id = ledger.next_call_id()
    ledger.append(
        Admitted(
            call_id=call_id,
            parent_id=parent.call_id if parent else None,
            prefix_len=parent.cum_len if parent else 0,
            admitted_at=admitted_at,
            request_fingerprint=request_fingerprint,
            formation="extend" if parent else "root",
        )
    )
    return call_id


def stage_call(
    ledger: Ledger,
    call_id: str,
    parent: StagedCall | None,
    *,
    prompt_ids: Iterable[int],
    output_ids: Iterable[int],
    logprobs: Iterable[float],
    finish_reason: str = "stop",
    weight_version: int = 0,
    weight_version_last: int | None = None,
    weight_versions: Spans | None = None,
    kv_versions: Spans | None = None,
    routes: Routes | None = None,
    response_id: str | None = None,
    output_fingerprint: str | Callable[[str], str] | None = None,
    media: Sequence[MediaItem] | None = None,
) -> StagedCall:
    """Build the call a gate stages for admitted ``call_id`` and append its ``Staged``.

    ``prompt_ids`` is the whole prompt (``parent``'s cumulative ids first; ``media`` place
    their items in it);
    ``output_fingerprint`` may be a function of the call's digest.
    """
    call = StagedCall.from_engine_output(
        rollout_id=ledger.rollout_id,
        call_id=call_id,
        parent_id=parent.call_id if parent else None,
        parent_cum_len=parent.cum_len if parent else 0,
        parent_chain_hash=parent.chain_hash if parent else None,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        weight_version=weight_version,
        weight_version_last=weight_version_last,
        weight_versions=weight_versions,
        kv_versions=kv_versions,
        routes=routes,
        media=media,
    )
    if callable(output_fingerprint):
        output_fingerprint = output_fingerprint(call.digest)
    ledger.append(
        Staged.for_call(call, response_id=response_id, output_fingerprint=output_fingerprint)
    )
    return call


def one_call_row(
    rollout_id: str,
    *,
    prompt_ids: Iterable[int],
    output_ids: Iterable[int],
    logprobs: Iterable[float],
    weight_version: int = 0,
    finish_reason: str = "stop",
    reward: float | None = None,
) -> TrainingRow:
    """The training row of a rollout of one call, made the way a gate's rows are: the call
    admitted and staged in a ledger, declared terminal, the rollout closed with ``reward``,
    its receipt assembled and the row reassembled (``prompt_ids`` carried, mask 0)."""
    ledger = Ledger(rollout_id)
    call_id = admit_call(ledger, None, admitted_at=1, request_fingerprint="req")
    call = stage_call(
        ledger,
        call_id,
        None,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        weight_version=weight_version,
    )
    ledger.append(TerminalDeclared(by="call_id", value=call_id))
    ledger.append(Closed(reward=reward))
    (row,) = reassemble(assemble_receipt(ledger.state), [call], max_seq_len=call.cum_len)
    return row


def _admit(
    call_id: str, parent: StagedCall | None, clock: int, rng: random.Random, root: int
) -> Admitted:
    fingerprint = f"req-{rng.getrandbits(64):016x}"
    splice_cause = rng.choice(SPLICE_CAUSES) if parent and rng.random() < 0.35 else None
    return Admitted(
        call_id=call_id,
        parent_id=parent.call_id if parent else None,
        prefix_len=parent.cum_len if parent else 0,
        admitted_at=clock,
        request_fingerprint=fingerprint,
        formation="root" if parent is None else ("splice" if splice_cause else "extend"),
        break_cause="history_rewritten" if parent is None and root > 0 else None,
        splice_cause=splice_cause,
    )


def _routes(rng: random.Random, rows: int) -> Routes:
    return routes_from_rows(
        [[[rng.randrange(8) for _ in range(2)] for _ in range(2)] for _ in range(rows)],
        dtype="int16",
    )
