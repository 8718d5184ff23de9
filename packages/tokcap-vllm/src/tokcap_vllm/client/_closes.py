"""Batch closes on the trainer's side: what to close (`RolloutClose`) and what came back
(`CloseResult`), one per rollout, never lost; each closed rollout's receipt.

A batch close (``POST /tokcap/v1/close``) closes a step's rollouts with one durable write
shared by all of them, where closing them one by one waits for one fsync each. Each
rollout's answer is its own: a rollout the gate does not know, or one already closed,
fails alone, with the typed error (`ControlNotFound`, `ControlConflict`, ...) its single
close would have raised.

Receipts from manifest bytes (`verified_receipt`): decoded, replayed and checked against
the head kept at close, or poisoned with the reason (never dropped). Both doors a manifest
comes through use it: ``GET …/manifest`` (`ControlPlaneClient.receipt`) and a batch close
that answers each closed rollout's manifest (``close_many(receipts=…)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, Protocol

import anyio
import attrs

from tokcap_core import (
    Manifest,
    Receipt,
    VerificationError,
    assemble_receipt,
    decode_manifest,
    verify_manifest,
)
from tokcap_core.ids import StagingKey, staging_key
from tokcap_core.ledger import Admitted, genesis_hash
from tokcap_core.reasons import make_reason

from ..api import MANIFEST_FAILURE_BUCKET, CloseManyItem, CloseOutcome, TerminalBody, WitnessBody
from ..errors import ControlPlaneError

__all__ = [
    "CloseResult",
    "RolloutClose",
    "manifest_failure",
    "poisoned_receipt",
    "release_all",
    "verified_receipt",
    "withdraw_open",
]

WITHDRAW_S = 10.0
"""How long `withdraw_open` tries before it gives up (the gate's lease reclaims the rest)."""


@attrs.frozen(kw_only=True)
class RolloutClose:
    """One rollout to close in a batch: its reward and the scorer's witnesses (as in
    `ControlPlaneClient.close`), and the terminal call its harness declared, if any
    (``terminal_call_id`` or ``terminal_response_id``, at most one: declared in the same
    request just before the close, as `ControlPlaneClient.declare_terminal` would, without
    its round trip; a declaration the gate refuses leaves the rollout open and is the
    rollout's `CloseResult.error`)."""

    rollout_id: str
    reward: float | None = None
    response_id: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    content_fingerprint: str | None = None
    terminal_call_id: str | None = None
    terminal_response_id: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.terminal_call_id is not None and self.terminal_response_id is not None:
            raise ValueError("declare the terminal by call id or by response id, not both")

    def wire(self) -> CloseManyItem:
        """The body item the control plane reads."""
        witnesses = WitnessBody(
            response_id=self.response_id,
            content=self.content,
            tool_calls=self.tool_calls,
            content_fingerprint=self.content_fingerprint,
        )
        terminal = None
        if self.terminal_call_id is not None or self.terminal_response_id is not None:
            terminal = TerminalBody(
                call_id=self.terminal_call_id, response_id=self.terminal_response_id
            )
        return CloseManyItem(
            rollout_id=self.rollout_id, reward=self.reward, witnesses=witnesses, terminal=terminal
        )


@attrs.frozen(kw_only=True)
class CloseResult:
    """One rollout's answer to a batch close: the durable ledger head, or the typed error."""

    rollout_id: str
    head: tuple[int, str] | None = None
    error: ControlPlaneError | None = None
    receipt: Receipt | None = None
    """With ``close_many(receipts=…)``: the rollout's receipt, verified against ``head``."""

    @property
    def ok(self) -> bool:
        """Whether the rollout closed and its head is durable."""
        return self.error is None

    def head_or_raise(self) -> tuple[int, str]:
        """The head; raises the rollout's error if it did not close durably."""
        if self.error is not None:
            raise self.error
        assert self.head is not None
        return self.head

    @classmethod
    def of(cls, outcome: CloseOutcome) -> CloseResult:
        """The result the control plane's `CloseOutcome` says."""
        if outcome.error is not None:
            e = outcome.error
            return cls(
                rollout_id=outcome.rollout_id,
                error=ControlPlaneError.of_status(e.status, e.code, e.message),
            )
        if outcome.head is None:
            raise ValueError("a close outcome holds a head or an error")
        head = (outcome.head.seq, outcome.head.hash)
        return cls(rollout_id=outcome.rollout_id, head=head)


async def release_all(
    release: Callable[[str], Awaitable[None]], rollout_ids: Iterable[str], limit: int
) -> None:
    """Run ``release`` on every id, ``limit`` at a time; the first `ControlPlaneError`
    raises once every release has been tried (one failure never skips the others)."""
    errors: list[ControlPlaneError] = []
    limiter = anyio.CapacityLimiter(limit)

    async def one(rollout_id: str) -> None:
        async with limiter:
            try:
                await release(rollout_id)
            except ControlPlaneError as e:
                errors.append(e)

    async with anyio.create_task_group() as tg:
        for rollout_id in rollout_ids:
            tg.start_soon(one, rollout_id)
    if errors:
        raise errors[0]


class Withdraws(Protocol):
    """What `withdraw_open` asks of a gate's client (`ControlPlaneClient` is one)."""

    async def close(self, rollout_id: str) -> tuple[int, str]:
        """Close the rollout without a reward."""
        ...

    async def release(self, rollout_id: str) -> None:
        """Make the gate forget the rollout."""
        ...


async def withdraw_open(client: Withdraws, rollout_id: str) -> None:
    """Undo an open whose answer never came back (the caller was cancelled, or it failed
    after the request left): the gate may hold the rollout though nobody knows its URL, so
    close it without a reward and release it. A gate that never opened it answers 404,
    which is fine; shielded, and at most `WITHDRAW_S` seconds."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(WITHDRAW_S):
        with contextlib.suppress(ControlPlaneError):
            await client.close(rollout_id)
        with contextlib.suppress(ControlPlaneError):
            await client.release(rollout_id)


def verified_receipt(
    rollout_id: str,
    data: bytes,
    *,
    expected_head: tuple[int, str] | None,
    segments: Literal["terminal", "all"],
    max_bytes: int,
) -> Receipt:
    """The receipt ``data`` (a manifest's bytes) gives ``rollout_id`` once it decodes, is
    that rollout's, replays, and ends at ``expected_head``; poisoned
    (``manifest_invalid:<code>``) otherwise."""
    manifest = None
    try:
        manifest = decode_manifest(data, max_bytes=max_bytes)
        if manifest.rollout_id != rollout_id:
            raise VerificationError("wrong_rollout", "the gate served another rollout")
        state = verify_manifest(manifest, expected_head=expected_head)
    except VerificationError as e:
        return manifest_failure(rollout_id, e.code, manifest)
    return assemble_receipt(state, segments=segments)


def manifest_failure(rollout_id: str, code: str, manifest: Manifest | None = None) -> Receipt:
    """A poisoned receipt for a rollout whose manifest is missing or does not verify."""
    return poisoned_receipt(rollout_id, make_reason(MANIFEST_FAILURE_BUCKET, code), manifest)


def poisoned_receipt(rollout_id: str, reason: str, manifest: Manifest | None = None) -> Receipt:
    """A poisoned receipt with ``reason`` for a rollout whose manifest cannot be trusted.

    Its ``sink_keys`` are the staging keys the (unverified) manifest admitted, if any, so
    cleanup can still free them (clearing an absent key is harmless).
    """
    keys: tuple[StagingKey, ...] = ()
    head = (0, genesis_hash(rollout_id))
    if manifest is not None and manifest.rollout_id == rollout_id:
        keys = tuple(
            staging_key(rollout_id, e.event.call_id)
            for e in manifest.entries
            if isinstance(e.event, Admitted)
        )
        head = manifest.head
    return Receipt(
        rollout_id=rollout_id,
        status="poisoned",
        failure_reason=reason,
        terminal_call_id=None,
        terminal_selection=None,
        segments=(),
        ledger_head=head,
        reward=None,
        sink_keys=keys,
        break_causes=(),
    )
