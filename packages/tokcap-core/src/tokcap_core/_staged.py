"""The staged call: one model call's exact token delta, as stored in a sink.

Invariants (checked in the constructor): ``parent_id is None`` exactly when
``prefix_len == 0``; ``gen_len >= 1``; ``len(tokens) == carry_len + gen_len``;
``len(logprobs) == gen_len`` with no NaN or +inf; routes, when present, have
one row per carried and generated token, plus a leading row when the call has
a parent: the engine's prefill route for the parent's last generated token,
which the parent's own pass never computed (reassembly uses it to backfill); media items
(format v4), when present, lie in the carried tokens in prompt order, apart.

``digest`` and ``chain_hash`` are *claims*: the constructor does not recompute
them (that is verification's job, against a receipt); `from_engine_output`
computes them from raw engine data.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from ._digest import CALL_DOMAIN, CALL_DOMAIN_V2, CALL_DOMAIN_V3, Canon, chain_hash
from ._errors import InvalidStagedCall, RoutesError
from ._media import MediaItem, check_media
from .ids import StagingKey, staging_key, validate_call_id, validate_rollout_id
from .provenance import Spans, VersionSpan, check_spans, single_span, token_versions
from .routes import Routes, align_routes

__all__ = [
    "FINISH_REASONS",
    "StagedCall",
    "check_provenance",
    "compute_call_digest",
    "logprob_array",
    "token_array",
]

FINISH_REASONS: Final[tuple[str, ...]] = ("stop", "length")
"""Finish reasons a staged (served, completed) call may carry."""

_HEX = frozenset("0123456789abcdef")
_UNSEALED = "0" * 64  # a well-formed placeholder until the digest over the fields is known

if array("I").itemsize != 4 or array("f").itemsize != 4:  # pragma: no cover - exotic platforms
    raise ImportError("tokcap_core needs array('I') and array('f') to be 4 bytes wide")


def token_array(values: Iterable[int]) -> array[int]:
    """Token ids as a compact u32 buffer; an ``array('I')`` is returned as is (zero-copy)."""
    return _compact("I", values, "bad_tokens", "token ids must be integers in [0, 2**32)")


def logprob_array(values: Iterable[float]) -> array[float]:
    """Logprobs as a compact f32 buffer; an ``array('f')`` is returned as is (zero-copy)."""
    return _compact("f", values, "bad_logprobs", "logprobs must be floats")


def _compact(typecode: str, values: Iterable[Any], code: str, rule: str) -> array[Any]:
    if isinstance(values, array) and values.typecode == typecode:
        return values
    try:
        return array(typecode, values)
    except (OverflowError, TypeError) as e:
        raise InvalidStagedCall(code, f"{rule}: {e}") from e


@dataclass(frozen=True, slots=True, kw_only=True, eq=True)
class StagedCall:
    """One call's token delta: carried prompt tokens + generated tokens, with their metadata."""

    rollout_id: str
    call_id: str
    parent_id: str | None
    prefix_len: int
    carry_len: int
    gen_len: int
    weight_version: int
    """The engine's weight version at the first generated token."""
    weight_version_last: int
    """The version at the last generated token (greater when weights were pushed mid-call)."""
    finish_reason: str
    tokens: array[int]
    logprobs: array[float]
    routes: Routes | None
    digest: str
    chain_hash: str
    weight_versions: Spans | None = None
    """Which weights sampled which generated tokens (format v3; None: a format v2 call)."""
    kv_versions: Spans | None = None
    """The oldest weights whose KV each generated token was conditioned on (format v3)."""
    media: tuple[MediaItem, ...] | None = None
    """The multimodal items whose placeholders lie in the carried tokens (format v4; None:
    a call of an earlier format)."""

    def __post_init__(self) -> None:
        validate_rollout_id(self.rollout_id)
        validate_call_id(self.call_id)
        if self.parent_id is not None:
            validate_call_id(self.parent_id)
        for name in ("prefix_len", "carry_len", "gen_len", "weight_version", "weight_version_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidStagedCall(
                    "bad_length", f"{name} must be a non-negative int, got {value!r}"
                )
        if (self.parent_id is None) != (self.prefix_len == 0):
            raise InvalidStagedCall(
                "parent_prefix_mismatch", "parent_id is None exactly when prefix_len == 0"
            )
        if self.gen_len < 1:
            raise InvalidStagedCall("empty_generation", "gen_len must be at least 1")
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidStagedCall(
                "bad_finish_reason", f"finish_reason must be one of {FINISH_REASONS}"
            )
        if not (isinstance(self.tokens, array) and self.tokens.typecode == "I"):
            raise InvalidStagedCall("bad_tokens", "tokens must be array('I'); use token_array()")
        if not (isinstance(self.logprobs, array) and self.logprobs.typecode == "f"):
            raise InvalidStagedCall(
                "bad_logprobs", "logprobs must be array('f'); use logprob_array()"
            )
        if len(self.tokens) != self.carry_len + self.gen_len:
            raise InvalidStagedCall(
                "token_count_mismatch", "len(tokens) must equal carry_len + gen_len"
            )
        if len(self.logprobs) != self.gen_len:
            raise InvalidStagedCall("logprob_count_mismatch", "len(logprobs) must equal gen_len")
        total = sum(self.logprobs)  # NaN or +inf anywhere makes the sum NaN or +inf
        if math.isnan(total) or total == math.inf:
            raise InvalidStagedCall("bad_logprobs", "logprobs must not be NaN or +inf")
        if self.routes is not None:
            if not isinstance(self.routes, Routes):
                raise InvalidStagedCall("bad_routes", "routes must be a Routes or None")
            if self.routes.shape[0] != self.route_rows:
                raise InvalidStagedCall(
                    "route_count_mismatch",
                    f"routes must have {self.route_rows} rows, got {self.routes.shape[0]}",
                )
        for name in ("digest", "chain_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
                raise InvalidStagedCall("bad_hash", f"{name} must be 64 lowercase hex characters")
        check_provenance(
            self.gen_len,
            self.weight_version,
            self.weight_version_last,
            self.weight_versions,
            self.kv_versions,
        )
        if self.media is not None:
            if self.weight_versions is None:
                raise InvalidStagedCall("bad_media", "media need a format v3 call's spans")
            if not isinstance(self.media, tuple):
                raise InvalidStagedCall("bad_media", "media must be a tuple of MediaItem")
            check_media(self.media, self.prefix_len, self.prefix_len + self.carry_len)

    @property
    def format(self) -> int:
        """The capture format of this call: 4 with media, 3 with spans, 2 without."""
        if self.media is not None:
            return 4
        return 2 if self.weight_versions is None else 3

    @property
    def cum_len(self) -> int:
        """Cumulative length of the conversation after this call: prefix + carry + generated."""
        return self.prefix_len + self.carry_len + self.gen_len

    @property
    def key(self) -> StagingKey:
        """This call's staging key, ``"{rollout_id}/{call_id}"``."""
        return staging_key(self.rollout_id, self.call_id)

    @property
    def route_rows(self) -> int:
        """How many route rows this call carries when it has routes (see module docstring)."""
        return self.carry_len + self.gen_len + (0 if self.parent_id is None else 1)

    @property
    def generated(self) -> memoryview:
        """The generated token ids, a zero-copy view."""
        return memoryview(self.tokens)[self.carry_len :]

    def compute_digest(self) -> str:
        """Recompute this call's digest from its fields (ignores the claimed ``digest``)."""
        return compute_call_digest(
            rollout_id=self.rollout_id,
            call_id=self.call_id,
            parent_id=self.parent_id,
            prefix_len=self.prefix_len,
            carry_len=self.carry_len,
            gen_len=self.gen_len,
            weight_version=self.weight_version,
            weight_version_last=self.weight_version_last,
            finish_reason=self.finish_reason,
            tokens=self.tokens,
            logprobs=self.logprobs,
            routes=self.routes,
            weight_versions=self.weight_versions,
            kv_versions=self.kv_versions,
            media=self.media,
        )

    @classmethod
    def from_engine_output(
        cls,
        *,
        rollout_id: str,
        call_id: str,
        parent_id: str | None,
        parent_cum_len: int,
        parent_chain_hash: str | None,
        prompt_ids: Iterable[int],
        output_ids: Iterable[int],
        logprobs: Iterable[float],
        finish_reason: str,
        weight_version: int,
        weight_version_last: int | None = None,
        routes: Routes | None = None,
        weight_versions: Sequence[VersionSpan] | None = None,
        kv_versions: Sequence[VersionSpan] | None = None,
        media: Sequence[MediaItem] | None = None,
    ) -> StagedCall:
        """Build a format v3 staged call (v4 with ``media``) from raw engine data, with its
        digest and chain hash.

        ``prompt_ids`` is the full prompt the engine saw (its first ``parent_cum_len``
        tokens are the parent's cumulative tokens); ``routes``, if any, cover the
        prompt and output as the engine returns them (``[tokens-1]`` or ``[tokens]`` rows).
        ``weight_versions`` (the sampling spans) default to ``weight_version`` over every
        token; a call that spans versions must give them (``weight_version_last`` then
        only has to agree). ``kv_versions`` default to ``weight_versions`` (every token
        conditioned on KV of its own version: no push kept stale KV). ``media`` place
        their items in ``prompt_ids`` (offsets count from its first token).
        """
        last = weight_version if weight_version_last is None else weight_version_last
        output = token_array(output_ids)
        if weight_versions is None:
            if last != weight_version:
                raise InvalidStagedCall(
                    "bad_spans", "a call sampled by two versions needs its weight_versions spans"
                )
            weight_versions = single_span(weight_version, len(output)) if output else ()
        spans = tuple(weight_versions)
        kv = spans if kv_versions is None else tuple(kv_versions)
        if spans:
            weight_version, last = spans[0].version, spans[-1].version
        prompt = token_array(prompt_ids)
        if parent_id is None and parent_cum_len != 0:
            raise InvalidStagedCall("parent_prefix_mismatch", "a root call has parent_cum_len == 0")
        if not 0 <= parent_cum_len <= len(prompt):
            raise InvalidStagedCall("bad_length", "parent_cum_len must lie within the prompt")
        tokens = prompt[parent_cum_len:]
        carry_len = len(tokens)
        tokens.extend(output)
        lp = logprob_array(logprobs)
        if routes is not None:
            try:
                aligned, _ = align_routes(routes, tokens=len(prompt) + len(output))
            except RoutesError as e:
                raise InvalidStagedCall("route_count_mismatch", str(e)) from e
            first = parent_cum_len - 1 if parent_id is not None else 0
            routes = _route_rows(aligned, first)
        unsealed = cls(
            rollout_id=rollout_id,
            call_id=call_id,
            parent_id=parent_id,
            prefix_len=parent_cum_len,
            carry_len=carry_len,
            gen_len=len(output),
            weight_version=weight_version,
            weight_version_last=last,
            finish_reason=finish_reason,
            tokens=tokens,
            logprobs=lp,
            routes=routes,
            digest=_UNSEALED,
            chain_hash=_UNSEALED,
            weight_versions=spans,
            kv_versions=kv,
            media=None if media is None else tuple(media),
        )
        digest = unsealed.compute_digest()
        return replace(unsealed, digest=digest, chain_hash=chain_hash(parent_chain_hash, digest))


def compute_call_digest(
    *,
    rollout_id: str,
    call_id: str,
    parent_id: str | None,
    prefix_len: int,
    carry_len: int,
    gen_len: int,
    weight_version: int,
    weight_version_last: int,
    finish_reason: str,
    tokens: array[int],
    logprobs: array[float],
    routes: Routes | None,
    weight_versions: Spans | None = None,
    kv_versions: Spans | None = None,
    media: Sequence[MediaItem] | None = None,
) -> str:
    """The call digest: commits to every field of a staged call (domain ``tokcap/call/v4``
    with its media; a format v3 call, spans and no media, hashes as before under
    ``tokcap/call/v3``, a format v2 call, without spans, under ``tokcap/call/v2``)."""
    if media is not None:
        domain = CALL_DOMAIN
    else:
        domain = CALL_DOMAIN_V2 if weight_versions is None else CALL_DOMAIN_V3
    canon = (
        Canon(domain)
        .text(rollout_id)
        .text(call_id)
        .opt_text(parent_id)
        .u64(prefix_len)
        .u64(carry_len)
        .u64(gen_len)
        .u64(weight_version)
        .u64(weight_version_last)
        .text(finish_reason)
        .buffer(tokens)
        .buffer(logprobs)
    )
    if routes is None:
        canon.u64(0)
    else:
        canon.u64(1).text(routes.dtype)
        for dim in routes.shape:
            canon.u64(dim)
        canon.buffer(routes.data)
    if weight_versions is not None:
        for spans in (weight_versions, kv_versions or ()):
            canon.u64(len(spans))
            for span in spans:
                canon.u64(span.version).u64(span.start).u64(span.end)
    if media is not None:
        canon.u64(len(media))
        for item in media:
            item.write(canon)
    return canon.hexdigest()


def check_provenance(
    gen_len: int, first: int, last: int, weight_versions: Spans | None, kv_versions: Spans | None
) -> None:
    """Raise `InvalidStagedCall` ``bad_spans`` unless the spans (both or neither) cover the
    generated tokens, agree with ``first``/``last`` and no token's KV is newer than the
    weights that sampled it."""
    if weight_versions is None:
        if kv_versions is not None:
            raise InvalidStagedCall("bad_spans", "kv_versions without weight_versions")
        return
    if kv_versions is None:
        raise InvalidStagedCall("bad_spans", "weight_versions without kv_versions")
    check_spans(weight_versions, gen_len, what="weight_versions")
    check_spans(kv_versions, gen_len, what="kv_versions")
    if (weight_versions[0].version, weight_versions[-1].version) != (first, last):
        raise InvalidStagedCall(
            "bad_spans", "weight_version and weight_version_last must be the spans' first and last"
        )
    sampled = token_versions(weight_versions)
    if any(k > v for k, v in zip(token_versions(kv_versions), sampled, strict=True)):
        raise InvalidStagedCall("bad_spans", "a token's KV is newer than the weights sampling it")


def _route_rows(routes: Routes, first: int) -> Routes:
    _, layers, topk = routes.shape
    width = layers * topk
    data = routes.data[first * width :]
    return Routes(dtype=routes.dtype, shape=(len(data) // width, layers, topk), data=data)
