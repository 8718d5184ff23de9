"""Training rows: one verified trajectory segment, laid out for a trainer.

Buffers are compact ``array`` objects (``input_ids`` u32, ``loss_mask`` u8,
``logprobs`` f32, routes small ints) that torch/numpy view without copying
(``torch.frombuffer``, ``numpy.frombuffer``). ``loss_mask`` is 1 exactly on
generated tokens; ``logprobs`` is 0.0 wherever the mask is 0. A placeholder row
stands in for an invalid rollout: ``sample_mask == 0`` and its failure reason.
A row built from calls with images names them (``media``: the calls' items, offsets
already the row's), so a trainer fetches each image's processed tensors by digest
(``tokcap_core.sink.fetch_media``) and never runs an image processor.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ._errors import InvalidStagedCall
from ._media import MediaItem, check_media
from .ids import TrainingKey, training_key
from .provenance import Spans
from .reasons import reason_bucket
from .routes import Routes, unknown_routes

if TYPE_CHECKING:
    from ._receipt import ReceiptCall
    from ._staged import StagedCall

__all__ = ["CallSpan", "TrainingRow", "placeholder_row"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CallSpan:
    """Where one call's tokens sit in a row: ``[start, start + carry_len + gen_len)``."""

    call_id: str
    start: int
    carry_len: int
    gen_len: int
    weight_version: int
    """The engine's weight version at the call's first generated token."""
    weight_version_last: int
    """The version at its last generated token (differs when weights were pushed mid-call)."""
    weight_versions: Spans | None = None
    """Which weights sampled which of the call's generated tokens (format v3; spans index
    its generated tokens, which start at ``start + carry_len`` in the row)."""
    kv_versions: Spans | None = None
    """The oldest weights whose KV each generated token was conditioned on (format v3)."""

    @classmethod
    def for_call(cls, call: StagedCall | ReceiptCall) -> CallSpan:
        """Where ``call`` sits in a row that starts at the conversation's first token: at its
        ``prefix_len``, every other field the call's own of the same name."""
        return cls(start=call.prefix_len, **{name: getattr(call, name) for name in _SAME_AS_CALL})


_SAME_AS_CALL: tuple[str, ...] = tuple(f.name for f in fields(CallSpan) if f.name != "start")
"""The fields a `CallSpan` copies from its call under the same name (all but ``start``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingRow:
    """A canonical training row (or a placeholder with ``sample_mask == 0``)."""

    rollout_id: str
    segment: int
    input_ids: array[int]
    loss_mask: array[int]
    logprobs: array[float]
    routes: Routes | None
    prompt_len: int
    """Tokens before the first generated token."""
    call_spans: tuple[CallSpan, ...]
    weight_version_min: int | None
    """The oldest weight version any generated token of the row was sampled under."""
    weight_version_max: int | None
    """The newest one (``weight_version_last`` of its calls included)."""
    truncated: bool
    """The terminal call stopped on ``"length"``, or the row was cut to ``max_seq_len``."""
    reward: float | None
    sample_mask: int
    reason: str | None
    """Why a placeholder is one (None for a valid row)."""
    terminal_call_id: str | None
    backfilled_route_rows: int = 0
    media: tuple[MediaItem, ...] = ()
    """The images whose placeholders lie in the row, in order (each call's items; a call's
    prompt offsets are the row's): fetch their tensors by ``tensors_digest``."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if self.media:
            if not isinstance(self.media, tuple):
                raise InvalidStagedCall("bad_media", "media must be a tuple of MediaItem")
            check_media(self.media, 0, n)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise InvalidStagedCall(
                "row_length_mismatch", "input_ids, loss_mask and logprobs differ in length"
            )
        if self.routes is not None and self.routes.shape[0] != n:
            raise InvalidStagedCall("row_length_mismatch", "routes must have one row per token")
        if self.sample_mask not in (0, 1) or (self.sample_mask == 0) != (self.reason is not None):
            raise InvalidStagedCall(
                "bad_sample_mask", "sample_mask is 0 exactly for placeholders, which carry a reason"
            )

    @property
    def key(self) -> TrainingKey:
        """This row's training-partition key."""
        return training_key(self.rollout_id, self.segment)

    @property
    def reason_bucket(self) -> str | None:
        """The failure bucket of a placeholder (for metrics), None for a valid row."""
        return None if self.reason is None else reason_bucket(self.reason)

    @property
    def num_generated(self) -> int:
        """How many tokens the loss is computed on."""
        return sum(self.loss_mask)


def placeholder_row(
    rollout_id: str,
    reason: str,
    *,
    like: TrainingRow | None = None,
    segment: int = 0,
    reward: float | None = None,
) -> TrainingRow:
    """The row a trainer pads in for an invalid rollout: one pad token, all masks 0.

    With ``like``, routes (if ``like`` has them) are all-unknown rows of the same
    ``[layers, topk]`` and dtype, so placeholders batch with real rows.
    """
    routes = None
    if like is not None and like.routes is not None:
        _, layers, topk = like.routes.shape
        routes = unknown_routes(1, layers=layers, topk=topk, dtype=like.routes.dtype)
    return TrainingRow(
        rollout_id=rollout_id,
        segment=segment,
        input_ids=array("I", [0]),
        loss_mask=array("B", [0]),
        logprobs=array("f", [0.0]),
        routes=routes,
        prompt_len=1,
        call_spans=(),
        weight_version_min=None,
        weight_version_max=None,
        truncated=False,
        reward=reward,
        sample_mask=0,
        reason=reason,
        terminal_call_id=None,
    )
