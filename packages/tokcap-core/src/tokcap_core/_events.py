"""Ledger events: token-free facts the gate records about a rollout's calls.

Events are frozen, slotted and keyword-only, and validate their own fields;
whether an event is legal *now* is the ledger's business (`_ledger`). Each
event has a ``KIND`` (its tag in canonical bytes and in manifests) and writes
its fields, in declaration order, into a `Canon` hash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Final, Literal, TypeAlias

from ._digest import LEDGER_DOMAIN, STAGED_ENTRY_DOMAIN, STAGED_ENTRY_DOMAIN_V3, Canon
from ._errors import InvalidStagedCall, LedgerProtocolError
from ._staged import FINISH_REASONS, StagedCall, check_provenance
from .ids import validate_call_id
from .provenance import Spans

__all__ = [
    "BREAK_CAUSES",
    "FORMATIONS",
    "SPLICE_CAUSES",
    "Admitted",
    "Closed",
    "Event",
    "Failed",
    "Poisoned",
    "Staged",
    "TerminalDeclared",
    "Witnesses",
]

BREAK_CAUSES: Final[tuple[str, ...]] = (
    "no_parent_match",
    "history_rewritten",
    "reasoning_stripped",
    "template_mismatch",
    "template_unstable",
    "image_changed",
    "image_dropped",
)
"""Why a later call of a rollout started a new root instead of extending a parent.

``template_mismatch``: the template renders the parent's generated turn differently and
the gate was told to break rather than splice; ``template_unstable``: appending the new
messages re-renders earlier history (other than stripped reasoning); ``image_changed``: the
history is a parent's conversation but for an image (other bytes at the same place, or
an image added or moved); ``image_dropped``: the history is a parent's conversation with
some of its images left out."""

FORMATIONS: Final[tuple[str, ...]] = ("root", "extend", "splice")
"""How a call's prompt was formed: a new root; its parent's exact ids extended by text
the template renders after the parent's exact text; or its parent's exact ids spliced
to the tokenised new messages where the template renders the parent's turn differently."""

SPLICE_CAUSES: Final[tuple[str, ...]] = (
    "special_tokens",
    "invalid_utf8",
    "tool_call_format",
    "whitespace",
    "reasoning",
    "other",
)
"""Why the template's rendering of a parent's turn differed from what it generated:
special tokens the returned content omits, bytes that decode to U+FFFD, tool calls the
parser re-serialised, whitespace a parser strips, reasoning the template drops (kept
by ``reasoning="keep_model_tokens"``), anything else."""

_HEX = frozenset("0123456789abcdef")


def _bad(code: str, message: str) -> LedgerProtocolError:
    return LedgerProtocolError(code, message)


def _check_hash(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise _bad("bad_event_field", f"{name} must be 64 lowercase hex characters")


def _check_label(name: str, value: object, *, optional: bool = False) -> None:
    """A short printable ASCII label (fingerprint, response id, reason): 1..256 chars."""
    if value is None and optional:
        return
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= 256
        or not value.isascii()
        or not value.isprintable()
    ):
        raise _bad("bad_event_field", f"{name} must be 1..256 printable ASCII characters")


def _check_count(name: str, value: object, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**63:
        raise _bad("bad_event_field", f"{name} must be an int >= {minimum}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """The gate admitted a call: its parent (or none: a root) and where its delta starts."""

    KIND: ClassVar[str] = "admitted"
    call_id: str
    parent_id: str | None
    prefix_len: int
    admitted_at: int
    """Unix time in nanoseconds, supplied by the caller (the core has no clock)."""
    request_fingerprint: str
    formation: str
    """How the prompt was formed (`FORMATIONS`): ``"root"`` exactly when there is no parent."""
    break_cause: str | None = None
    """For a root that is not the rollout's first call: why no parent matched."""
    splice_cause: str | None = None
    """For a ``"splice"``: why the template's rendering of the parent's turn differed."""

    def __post_init__(self) -> None:
        validate_call_id(self.call_id)
        if self.parent_id is not None:
            validate_call_id(self.parent_id)
        _check_count("prefix_len", self.prefix_len)
        _check_count("admitted_at", self.admitted_at)
        _check_label("request_fingerprint", self.request_fingerprint)
        if (self.parent_id is None) != (self.prefix_len == 0):
            raise _bad("bad_event_field", "parent_id is None exactly when prefix_len == 0")
        if self.formation not in FORMATIONS:
            raise _bad("bad_event_field", f"formation must be one of {FORMATIONS}")
        if (self.formation == "root") != (self.parent_id is None):
            raise _bad("bad_event_field", "formation is 'root' exactly when parent_id is None")
        if self.break_cause is not None:
            if self.parent_id is not None:
                raise _bad("bad_event_field", "only a root call carries a break_cause")
            if self.break_cause not in BREAK_CAUSES:
                raise _bad("bad_event_field", f"break_cause must be one of {BREAK_CAUSES}")
        if (self.formation == "splice") != (self.splice_cause is not None):
            raise _bad("bad_event_field", "a splice, and only a splice, carries a splice_cause")
        if self.splice_cause is not None and self.splice_cause not in SPLICE_CAUSES:
            raise _bad("bad_event_field", f"splice_cause must be one of {SPLICE_CAUSES}")

    def write(self, canon: Canon) -> None:
        """Write this event's canonical fields."""
        canon.text(self.call_id).opt_text(self.parent_id).u64(self.prefix_len).u64(self.admitted_at)
        canon.text(self.request_fingerprint).text(self.formation).opt_text(self.break_cause)
        canon.opt_text(self.splice_cause)


@dataclass(frozen=True, slots=True, kw_only=True)
class Staged:
    """The sink acknowledged the call's tokens; the call is committed under these coordinates."""

    KIND: ClassVar[str] = "staged"
    call_id: str
    carry_len: int
    gen_len: int
    weight_version: int
    """The engine's weight version at the call's first generated token."""
    weight_version_last: int
    """The version at its last generated token (a push happened mid-call when they differ)."""
    finish_reason: str
    call_digest: str
    chain_hash: str
    response_id: str | None = None
    output_fingerprint: str | None = None
    weight_versions: Spans | None = None
    """Format v3: which weights sampled which generated tokens (None: a format v2 event)."""
    kv_versions: Spans | None = None
    """Format v3: the oldest weights whose KV each generated token was conditioned on."""
    media_digests: tuple[str, ...] | None = None
    """Format v4: the SHA-256 of each media item's bytes, in prompt order (None: an earlier
    format), so a manifest alone names the images a call saw."""

    def __post_init__(self) -> None:
        validate_call_id(self.call_id)
        _check_count("carry_len", self.carry_len)
        _check_count("gen_len", self.gen_len, minimum=1)
        _check_count("weight_version", self.weight_version)
        _check_count("weight_version_last", self.weight_version_last)
        if self.finish_reason not in FINISH_REASONS:
            raise _bad("bad_event_field", f"finish_reason must be one of {FINISH_REASONS}")
        _check_hash("call_digest", self.call_digest)
        _check_hash("chain_hash", self.chain_hash)
        _check_label("response_id", self.response_id, optional=True)
        _check_label("output_fingerprint", self.output_fingerprint, optional=True)
        try:
            check_provenance(
                self.gen_len,
                self.weight_version,
                self.weight_version_last,
                self.weight_versions,
                self.kv_versions,
            )
        except InvalidStagedCall as e:
            raise _bad("bad_event_field", e.message) from e
        if self.media_digests is not None:
            if self.weight_versions is None or not isinstance(self.media_digests, tuple):
                raise _bad("bad_event_field", "media_digests are a tuple, with spans")
            for digest in self.media_digests:
                _check_hash("media_digests", digest)

    @property
    def domain(self) -> bytes:
        """The entry-hash domain: format v4 events (naming media) hash apart from v3 ones
        (with spans), which hash apart from v2 ones."""
        if self.media_digests is not None:
            return STAGED_ENTRY_DOMAIN
        return LEDGER_DOMAIN if self.weight_versions is None else STAGED_ENTRY_DOMAIN_V3

    @classmethod
    def for_call(
        cls,
        call: StagedCall,
        *,
        response_id: str | None = None,
        output_fingerprint: str | None = None,
    ) -> Staged:
        """The ``Staged`` that commits ``call``: its lengths, versions, digest and chain hash."""
        return cls(
            call_id=call.call_id,
            carry_len=call.carry_len,
            gen_len=call.gen_len,
            weight_version=call.weight_version,
            weight_version_last=call.weight_version_last,
            finish_reason=call.finish_reason,
            call_digest=call.digest,
            chain_hash=call.chain_hash,
            response_id=response_id,
            output_fingerprint=output_fingerprint,
            weight_versions=call.weight_versions,
            kv_versions=call.kv_versions,
            media_digests=None
            if call.media is None
            else tuple(item.bytes_sha256 for item in call.media),
        )

    def write(self, canon: Canon) -> None:
        """Write this event's canonical fields (format v3: the spans after the v2 fields;
        format v4: then the media digests)."""
        canon.text(self.call_id).u64(self.carry_len).u64(self.gen_len).u64(self.weight_version)
        canon.u64(self.weight_version_last).text(self.finish_reason)
        canon.raw_hash(self.call_digest).raw_hash(self.chain_hash)
        canon.opt_text(self.response_id).opt_text(self.output_fingerprint)
        if self.weight_versions is not None:
            for spans in (self.weight_versions, self.kv_versions or ()):
                canon.u64(len(spans))
                for span in spans:
                    canon.u64(span.version).u64(span.start).u64(span.end)
        if self.media_digests is not None:
            canon.u64(len(self.media_digests))
            for digest in self.media_digests:
                canon.raw_hash(digest)


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """The call failed. ``served=False``: no completion ever reached the harness (off-chain)."""

    KIND: ClassVar[str] = "failed"
    call_id: str
    reason: str
    served: bool

    def __post_init__(self) -> None:
        validate_call_id(self.call_id)
        _check_label("reason", self.reason)
        if not isinstance(self.served, bool):
            raise _bad("bad_event_field", "served must be a bool")

    def write(self, canon: Canon) -> None:
        """Write this event's canonical fields."""
        canon.text(self.call_id).text(self.reason).u64(self.served)


@dataclass(frozen=True, slots=True, kw_only=True)
class TerminalDeclared:
    """The harness named the rollout's terminal call, by call id or by response id."""

    KIND: ClassVar[str] = "terminal_declared"
    by: Literal["call_id", "response_id"]
    value: str

    def __post_init__(self) -> None:
        if self.by not in ("call_id", "response_id"):
            raise _bad("bad_event_field", "by must be 'call_id' or 'response_id'")
        _check_label("value", self.value)

    def write(self, canon: Canon) -> None:
        """Write this event's canonical fields."""
        canon.text(self.by).text(self.value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Witnesses:
    """What the scorer saw: the scored response id and/or a fingerprint of the scored content."""

    response_id: str | None = None
    content_fingerprint: str | None = None

    def __post_init__(self) -> None:
        _check_label("response_id", self.response_id, optional=True)
        _check_label("content_fingerprint", self.content_fingerprint, optional=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Closed:
    """The rollout ended, with its reward (if scored) and the scorer's witnesses."""

    KIND: ClassVar[str] = "closed"
    reward: float | None
    witnesses: Witnesses = Witnesses()

    def __post_init__(self) -> None:
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
                raise _bad("bad_event_field", "reward must be a float or None")
            if not math.isfinite(self.reward):
                raise _bad("bad_event_field", "reward must be finite")
            object.__setattr__(self, "reward", float(self.reward))
        if not isinstance(self.witnesses, Witnesses):
            raise _bad("bad_event_field", "witnesses must be a Witnesses")

    def write(self, canon: Canon) -> None:
        """Write this event's canonical fields."""
        canon.opt_f64(self.reward).opt_text(self.witnesses.response_id).opt_text(
            self.witnesses.content_fingerprint
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Poisoned:
    """The gate gave up on the whole rollout (e.g. it was open when the gate crashed)."""

    KIND: ClassVar[str] = "poisoned"
    reason: str

    def __post_init__(self) -> None:
        _check_label("reason", self.reason)

    def write(self, canon: Canon) -> None:
        """Write this event's canonical fields."""
        canon.text(self.reason)


Event: TypeAlias = Admitted | Staged | Failed | TerminalDeclared | Closed | Poisoned
"""Any ledger event."""

EVENT_TYPES: Final[tuple[type[Event], ...]] = (
    Admitted,
    Staged,
    Failed,
    TerminalDeclared,
    Closed,
    Poisoned,
)
