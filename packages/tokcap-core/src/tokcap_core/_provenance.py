"""Per-token provenance: which weights sampled each generated token, and which weights
computed the KV it was conditioned on (capture format v3).

A call's generated tokens ``[0, gen_len)`` are covered by *spans* ``VersionSpan(version,
start, end)``, in order, contiguous, each non-empty, neighbours of different versions:

- ``weight_versions``: the weights that sampled tokens ``[start, end)`` (vLLM's
  ``CompletionOutput.weight_versions``, labels read as integers).
- ``kv_versions``: the *oldest* weights whose KV cache tokens ``[start, end)`` were
  conditioned on; never above the token's sampling version.

In both lists each span's version is above the one before (versions only grow).

How a push treats calls in flight decides the KV spans (`kv_spans`): ``recompute`` (vLLM
preempts running requests and recomputes their KV with the new weights) leaves every
token conditioned on KV of its own sampling version; ``keep`` (running requests keep
their KV) leaves tokens sampled after the push conditioned on the older KV: *stale-KV
tokens*. A token's *staleness* is the trained version minus its sampling version.

Everything here is pure; staleness can be computed from receipts alone (the ledger binds
both span lists), which is what `check_staleness` does for ``tokcap-core verify``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidStagedCall, VerificationError

__all__ = [
    "Spans",
    "Staleness",
    "StalenessViolation",
    "VersionSpan",
    "check_spans",
    "check_staleness",
    "clip_spans",
    "kv_spans",
    "receipt_staleness",
    "row_staleness",
    "single_span",
    "spans_from_json",
    "spans_to_json",
    "token_versions",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionSpan:
    """Generated tokens ``[start, end)`` of one call and a weight version."""

    version: int
    start: int
    end: int

    def __post_init__(self) -> None:
        for name in ("version", "start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidStagedCall("bad_spans", f"span {name} must be an int >= 0: {value!r}")
        if self.end <= self.start:
            raise InvalidStagedCall("bad_spans", f"an empty span [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        """How many tokens the span covers."""
        return self.end - self.start


Spans = tuple[VersionSpan, ...]
"""A call's spans over its generated tokens (see the module docstring)."""


def single_span(version: int, gen_len: int) -> Spans:
    """One version over all ``gen_len`` tokens (a call no push interrupted)."""
    return (VersionSpan(version=version, start=0, end=gen_len),)


def check_spans(spans: Sequence[VersionSpan], gen_len: int, *, what: str) -> None:
    """Raise `InvalidStagedCall` (``bad_spans``) unless ``spans`` cover ``[0, gen_len)`` in
    order, each span's version above the one before (neighbours differ, none falls)."""
    if not spans:
        raise InvalidStagedCall("bad_spans", f"{what}: no span")
    at, previous = 0, -1
    for span in spans:
        if not isinstance(span, VersionSpan):
            raise InvalidStagedCall("bad_spans", f"{what}: spans must be VersionSpan")
        if span.start != at:
            raise InvalidStagedCall("bad_spans", f"{what}: spans are not contiguous from 0")
        if span.version <= previous:
            raise InvalidStagedCall("bad_spans", f"{what}: each span's version must rise")
        at, previous = span.end, span.version
    if at != gen_len:
        raise InvalidStagedCall("bad_spans", f"{what}: spans end at {at}, gen_len is {gen_len}")


def clip_spans(spans: Spans | None, length: int) -> Spans | None:
    """The spans of the first ``length`` tokens (a row cut to ``max_seq_len``)."""
    if spans is None:
        return None
    return tuple(
        VersionSpan(version=s.version, start=s.start, end=min(s.end, length))
        for s in spans
        if s.start < length
    )


def token_versions(spans: Iterable[VersionSpan]) -> list[int]:
    """One version per token (``spans`` expanded, in order)."""
    return [s.version for s in spans for _ in range(s.length)]


def kv_spans(
    weight_versions: Sequence[VersionSpan], *, salt_version: int, recomputed: Callable[[int], bool]
) -> Spans:
    """The KV spans of a call from its sampling spans and how pushes treated calls in flight.

    ``salt_version``: the version the call's prompt was salted with when admitted (its
    prompt KV may come from cached blocks of that version); ``recomputed(v)``: whether the
    push that loaded version ``v`` recomputed the KV of requests in flight (and reset the
    prefix cache). A token's KV version is the newest version ``r <= `` its sampling version
    whose push recomputed, above the KV version before it; if none, the older one stays.
    """
    out: list[VersionSpan] = []
    kv, below = salt_version, salt_version
    for span in weight_versions:
        for v in range(span.version, below, -1):
            if recomputed(v):
                kv = v
                break
        kv = min(kv, span.version)
        below = span.version
        if out and out[-1].version == kv:
            out[-1] = VersionSpan(version=kv, start=out[-1].start, end=span.end)
        else:
            out.append(VersionSpan(version=kv, start=span.start, end=span.end))
    return tuple(out)


def spans_to_json(spans: Spans | None) -> list[list[int]] | None:
    """``[[version, start, end], ...]`` (None stays None: a format v2 call)."""
    return None if spans is None else [[s.version, s.start, s.end] for s in spans]


def spans_from_json(value: Any) -> Spans | None:
    """The spans of `spans_to_json` (or of msgspec's ``{"version", "start", "end"}`` objects);
    `InvalidStagedCall` ``bad_spans`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidStagedCall("bad_spans", "spans must be a list")
    out = []
    for item in value:
        if isinstance(item, dict) and set(item) == {"version", "start", "end"}:
            item = [item["version"], item["start"], item["end"]]
        if not isinstance(item, list) or len(item) != 3:
            raise InvalidStagedCall("bad_spans", "a span is [version, start, end]")
        out.append(VersionSpan(version=item[0], start=item[1], end=item[2]))
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Staleness:
    """How far behind the trained weights a set of generated tokens was sampled."""

    tokens: int
    """Generated tokens counted."""
    staleness_max: int
    """The largest trained-version minus sampled-version (0 with no tokens)."""
    stale_tokens: int
    """Tokens sampled at least one version behind."""
    stale_kv_tokens: int
    """Tokens conditioned on KV older than the weights that sampled them."""
    calls_spanning_versions: int
    """Calls whose tokens were sampled by more than one version."""
    unknown_tokens: int = 0
    """Tokens of format v2 calls: only their first and last versions are known, and the
    oldest is assumed for all (stale-KV unknown, counted as none)."""

    def __add__(self, other: Staleness) -> Staleness:
        return Staleness(
            tokens=self.tokens + other.tokens,
            staleness_max=max(self.staleness_max, other.staleness_max),
            stale_tokens=self.stale_tokens + other.stale_tokens,
            stale_kv_tokens=self.stale_kv_tokens + other.stale_kv_tokens,
            calls_spanning_versions=self.calls_spanning_versions + other.calls_spanning_versions,
            unknown_tokens=self.unknown_tokens + other.unknown_tokens,
        )


_NONE = Staleness(
    tokens=0, staleness_max=0, stale_tokens=0, stale_kv_tokens=0, calls_spanning_versions=0
)


def _call_staleness(
    trained_version: int,
    gen_len: int,
    first: int,
    weight_versions: Spans | None,
    kv_versions: Spans | None,
) -> Staleness:
    if weight_versions is None:  # format v2: the oldest version for every token
        return Staleness(
            tokens=gen_len,
            staleness_max=max(trained_version - first, 0) if gen_len else 0,
            stale_tokens=gen_len if trained_version > first else 0,
            stale_kv_tokens=0,
            calls_spanning_versions=0,
            unknown_tokens=gen_len,
        )
    stale = sum(s.length for s in weight_versions if trained_version > s.version)
    kv = token_versions(kv_versions or weight_versions)
    sampled = token_versions(weight_versions)
    return Staleness(
        tokens=gen_len,
        staleness_max=max(
            (max(trained_version - s.version, 0) for s in weight_versions), default=0
        ),
        stale_tokens=stale,
        stale_kv_tokens=sum(k < v for k, v in zip(kv, sampled, strict=True)),
        calls_spanning_versions=int(len(weight_versions) > 1),
    )


def row_staleness(row: Any, trained_version: int) -> Staleness:
    """The staleness of a `TrainingRow`'s generated tokens against ``trained_version``
    (a placeholder row, with no call spans, counts nothing)."""
    total = _NONE
    for span in row.call_spans:
        total = total + _call_staleness(
            trained_version,
            span.gen_len,
            span.weight_version,
            span.weight_versions,
            span.kv_versions,
        )
    return total


def receipt_staleness(receipt: Any, trained_version: int) -> Staleness:
    """The staleness of every generated token a verified `Receipt`'s segments name, from the
    ledger's spans alone (no staged row needed)."""
    total = _NONE
    for segment in receipt.segments:
        for call in segment:
            total = total + _call_staleness(
                trained_version,
                call.gen_len,
                call.weight_version,
                call.weight_versions,
                call.kv_versions,
            )
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class StalenessViolation:
    """One rollout over the bound: its id and its `Staleness`."""

    rollout_id: str
    staleness: Staleness


def check_staleness(
    receipts: Iterable[Any], *, trained_version: int, max_staleness: int, raise_: bool = False
) -> list[StalenessViolation]:
    """The verified receipts holding a token sampled more than ``max_staleness`` versions
    behind ``trained_version`` (poisoned receipts train nothing and are skipped).

    With ``raise_``, a non-empty answer raises `VerificationError` ``stale_tokens`` instead.
    """
    if max_staleness < 0 or trained_version < 0:
        raise ValueError("trained_version and max_staleness are >= 0")
    out = []
    for receipt in receipts:
        if not receipt.ok:
            continue
        staleness = receipt_staleness(receipt, trained_version)
        if staleness.staleness_max > max_staleness:
            out.append(StalenessViolation(rollout_id=receipt.rollout_id, staleness=staleness))
    if out and raise_:
        worst = max(v.staleness.staleness_max for v in out)
        raise VerificationError(
            "stale_tokens",
            f"{len(out)} rollout(s) hold tokens up to {worst} versions behind {trained_version} "
            f"(bound {max_staleness})",
        )
    return out
