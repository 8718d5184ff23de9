"""Staged calls and training rows <-> the TensorDict layout TransferQueue stores.

Every variable-length column is a nested tensor (one component per key; written strided,
read back jagged, see `_nested`); scalar metadata rides in one JSON string column,
``meta``, so a row's key is always readable.

Staging partition (exact: the decoded call's digest verifies):
- ``tokens`` int32: the u32 token ids, bit for bit;
- ``logprobs`` float32;
- ``routes`` int16, flattened ``[S*L*K]`` (one ``-1`` word when the call has none: TQ cannot
  store an empty component): int8 ids widened
  by value, int16 as is, int32 bit-split into two int16 words; ``meta`` records the
  original dtype and shape, so decoding restores the very array the digest covers.

Media partition: ``blob`` uint8, one media blob (``tokcap_core.staged.media_blob``) per
image, keyed by its tensors digest, bit for bit.

Training partition (trainer-ready): ``input_ids`` int64, ``loss_mask`` uint8, ``logprobs``
float32, ``routes`` int32 flattened (widened for NCCL, which has no int16; one ``-1`` when
none), ``sample_mask`` int64 per row; ``meta`` keeps the original routes dtype, so a
fetched `TrainingRow` equals the published one.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tokcap_core import SinkError, StagedCall, TrainingRow
from tokcap_core.provenance import Spans, VersionSpan, spans_from_json, spans_to_json
from tokcap_core.routes import Routes, widen
from tokcap_core.rows import CallSpan
from tokcap_core.staged import media_from_json, media_to_json

from ._deps import np, torch
from ._deps import tensordict as _td

__all__ = [
    "MEDIA_FIELDS",
    "STAGING_FIELDS",
    "TRAINING_FIELDS",
    "decode_media",
    "decode_rows",
    "decode_staged",
    "encode_media",
    "encode_rows",
    "encode_staged",
    "to_padded_batch",
]

STAGING_FIELDS = ("tokens", "logprobs", "routes", "meta")
MEDIA_FIELDS = ("blob",)
TRAINING_FIELDS = ("input_ids", "loss_mask", "logprobs", "routes", "sample_mask", "meta")

# ``meta`` holds every scalar field of the record type (read off the dataclass, so a field
# the core adds travels without a change here) plus the routes' dtype and shape.
_STAGED_META = tuple(f.name for f in dataclasses.fields(StagedCall) if f.name not in STAGING_FIELDS)
_ROW_META = tuple(
    f.name
    for f in dataclasses.fields(TrainingRow)
    if f.name not in TRAINING_FIELDS and f.name not in ("call_spans", "media")
)
_SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(CallSpan))

_ROUTE_TYPECODE = {"int8": "b", "int16": "h", "int32": "i"}
_NP_DTYPE = {"int8": np.int8, "int16": np.int16, "int32": np.int32}
_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


def _nested(parts: Sequence[Any], dtype: Any) -> Any:
    """One nested tensor from per-row numpy arrays (empty rows allowed), in the strided
    layout: TransferQueue's put unbinds every nested column three times (its schema twice,
    its routing once), and a strided unbind is one native call where a jagged one runs
    through torch's Python dispatch (a 32-row publish here: 9.6 ms jagged, 6.8 strided).
    Reads come back jagged either way (TransferQueue packs what it returns itself)."""
    if not parts:  # no rows: nothing to unbind, and a strided layout needs one
        empty = torch.zeros(0, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
        return torch.nested.nested_tensor_from_jagged(empty, torch.zeros(1, dtype=torch.int64))
    with warnings.catch_warnings():  # torch calls the strided layout a prototype, and a
        warnings.simplefilter("ignore", UserWarning)  # read-only row buffer "not writable"
        # one copy, into the nested tensor's own buffer; nothing writes through the views
        rows = [torch.from_numpy(np.asarray(p).astype(dtype, copy=False)) for p in parts]
        return torch.nested.as_nested_tensor(rows, layout=torch.strided)


class _Column:
    """A jagged column read as one numpy array: row ``i`` is ``values[at[i]:at[i + 1]]``."""

    __slots__ = ("at", "bytes", "itemsize", "values")

    def __init__(self, column: Any) -> None:
        if not getattr(column, "is_nested", False):
            raise SinkError("bad_layout", f"expected a jagged column, got {type(column).__name__}")
        if column.layout == torch.strided:  # as `_nested` writes it, read without TQ
            parts = column.unbind()
            self.at: list[int] = [0, *itertools.accumulate(len(p) for p in parts)]
            self.values = torch.cat(parts).numpy() if parts else np.zeros(0, np.int64)
        else:
            # A jagged tensor's public ``values()`` goes through torch's dispatcher (~60 us
            # a call here, a tenth of decoding 64 rows); the tensors it returns are these.
            values = getattr(column, "_values", None)
            offsets = getattr(column, "_offsets", None)
            if values is None or offsets is None:
                values, offsets = column.values(), column.offsets()
            self.values = values.numpy()
            self.at = offsets.tolist()
        self.itemsize = self.values.itemsize
        self.bytes = np.ascontiguousarray(self.values).data.cast("B")

    def row(self, i: int) -> Any:
        return self.values[self.at[i] : self.at[i + 1]]

    def array(self, i: int, typecode: str) -> array[Any]:
        """Row ``i`` copied into an ``array`` of ``typecode`` (same item size as the column)."""
        out = array(typecode)
        out.frombytes(self.bytes[self.at[i] * self.itemsize : self.at[i + 1] * self.itemsize])
        return out


def _strings(column: Any) -> list[str]:
    return [s if isinstance(s, str) else str(s) for s in column]


def _routes_to_int16(routes: Routes) -> Any:
    data = np.frombuffer(routes.data, dtype=_NP_DTYPE[routes.dtype])
    return data.view(np.int16) if routes.dtype == "int32" else data.astype(np.int16)


def _routes_from(words: Any, shape: list[Any]) -> Routes:
    """Routes of ``shape = [dtype, tokens, layers, topk]`` from a column row of any int type."""
    dtype, s, layers, topk = shape
    target = _NP_DTYPE[dtype]
    if words.dtype == np.int16 and dtype == "int32":  # the staging layout's bit split
        words = words.view(np.int32)
    data = array(_ROUTE_TYPECODE[dtype])
    data.frombytes(np.ascontiguousarray(words.astype(target, copy=False)).data.cast("B"))
    return Routes(dtype=dtype, shape=(s, layers, topk), data=data)


def _routes_meta(routes: Routes | None) -> list[Any] | None:
    return None if routes is None else [routes.dtype, *routes.shape]


# TQ's storage cannot serialise a zero-length component; ``meta`` says there are no routes.
_NO_ROUTES16 = np.full(1, -1, np.int16)
_NO_ROUTES32 = np.full(1, -1, np.int32)


def encode_staged(calls: Sequence[StagedCall]) -> Any:
    """A TensorDict of ``calls`` in the staging layout (batch size ``len(calls)``)."""
    meta = []
    for c in calls:
        m = {name: getattr(c, name) for name in _STAGED_META}
        m["routes"] = _routes_meta(c.routes)
        m["weight_versions"] = spans_to_json(c.weight_versions)
        m["kv_versions"] = spans_to_json(c.kv_versions)
        m["media"] = None if c.media is None else media_to_json(c.media)
        meta.append(_json_encode(m).decode())
    return _td.TensorDict(
        {
            "tokens": _nested([np.frombuffer(c.tokens, np.int32) for c in calls], np.int32),
            "logprobs": _nested([np.frombuffer(c.logprobs, np.float32) for c in calls], np.float32),
            "routes": _nested(
                [_NO_ROUTES16 if c.routes is None else _routes_to_int16(c.routes) for c in calls],
                np.int16,
            ),
            "meta": _td.NonTensorStack(*meta),
        },
        batch_size=[len(calls)],
    )


def decode_staged(td: Any) -> list[StagedCall]:
    """The staged calls of a staging-layout TensorDict, in row order (each one validated)."""
    return _decode_staged(td, _checked_call)


def decode_own_staged(td: Any) -> list[StagedCall]:
    """`decode_staged` for rows a `TQSink` wrote itself: the constructor's checks are skipped.

    They ran when the calls were built, before the put; TQ hands back the bytes it was
    given; and verification recomputes every call's digest before a row is trained on
    (``tokcap_core.verify_staged``). Skipping them is most of what a get costs over raw
    TQ (a sum over every logprob, per call). A row whose fields are not the dataclass's
    is ``bad_layout``.
    """
    return _decode_staged(td, _trusted_call)


_CALL_FIELDS = tuple(f.name for f in dataclasses.fields(StagedCall))
_SET = object.__setattr__
# The slots' own setters: a frozen dataclass refuses ``setattr``, its slot descriptors do
# not, and calling them skips the attribute lookup ``object.__setattr__`` makes per field.
_CALL_SETTERS = tuple((name, getattr(StagedCall, name).__set__) for name in _CALL_FIELDS)
_SPAN_VERSION, _SPAN_START, _SPAN_END = (
    getattr(VersionSpan, name).__set__ for name in ("version", "start", "end")
)


def _checked_call(values: dict[str, Any]) -> StagedCall:
    return StagedCall(**values)


def _trusted_call(values: dict[str, Any]) -> StagedCall:
    if len(values) != len(_CALL_FIELDS):
        raise SinkError("bad_layout", f"a staged row has fields {sorted(values)}")
    call = object.__new__(StagedCall)
    try:
        for name, setter in _CALL_SETTERS:
            setter(call, values[name])
    except KeyError as e:
        raise SinkError("bad_layout", f"a staged row has no {e.args[0]!r}") from None
    return call


def _decode_staged(td: Any, make: Callable[[dict[str, Any]], StagedCall]) -> list[StagedCall]:
    tokens, logprobs, routes = _Column(td["tokens"]), _Column(td["logprobs"]), _Column(td["routes"])
    out = []
    for i, raw in enumerate(_strings(td["meta"])):
        m = _json_decode(raw)
        shape = m["routes"]
        m["tokens"] = tokens.array(i, "I")
        m["logprobs"] = logprobs.array(i, "f")
        m["routes"] = None if shape is None else _routes_from(routes.row(i), shape)
        m["weight_versions"] = _spans(m.get("weight_versions"))
        m["kv_versions"] = _spans(m.get("kv_versions"))
        media = m.get("media")  # absent in rows written before format v4
        m["media"] = None if media is None else media_from_json(media)
        out.append(make(m))
    return out


def _spans(value: Any) -> Spans | None:
    """`spans_from_json` with its checks inlined for the layout `spans_to_json` writes.

    The same checks (ints, not bools, ``>= 0``, non-empty), without a ``__post_init__``
    per span: two span lists per row were a third of decoding a staged row. Anything
    else (msgspec's object form, a bad value) goes to `spans_from_json` for its typed error.
    """
    if type(value) is not list:
        return spans_from_json(value)
    out = []
    for item in value:
        if type(item) is list and len(item) == 3:
            version, start, end = item
            if (
                type(version) is int
                and type(start) is int
                and type(end) is int
                and version >= 0
                and 0 <= start < end
            ):
                span = object.__new__(VersionSpan)
                _SPAN_VERSION(span, version)
                _SPAN_START(span, start)
                _SPAN_END(span, end)
                out.append(span)
                continue
        return spans_from_json(value)
    return tuple(out)


def _span_meta(span: CallSpan) -> dict[str, Any]:
    m = {n: getattr(span, n) for n in _SPAN_FIELDS}
    m["weight_versions"] = spans_to_json(span.weight_versions)
    m["kv_versions"] = spans_to_json(span.kv_versions)
    return m


def _span_from(m: dict[str, Any]) -> CallSpan:
    m["weight_versions"] = spans_from_json(m.get("weight_versions"))
    m["kv_versions"] = spans_from_json(m.get("kv_versions"))
    return CallSpan(**m)


def encode_rows(rows: Sequence[TrainingRow]) -> Any:
    """A TensorDict of ``rows`` in the training layout (routes widened to int32)."""
    meta = []
    for r in rows:
        m = {name: getattr(r, name) for name in _ROW_META}
        m["call_spans"] = [_span_meta(s) for s in r.call_spans]
        m["routes"] = _routes_meta(r.routes)
        m["media"] = media_to_json(r.media)
        meta.append(_json_encode(m).decode())
    return _td.TensorDict(
        {
            "input_ids": _nested([np.frombuffer(r.input_ids, np.uint32) for r in rows], np.int64),
            "loss_mask": _nested([np.frombuffer(r.loss_mask, np.uint8) for r in rows], np.uint8),
            "logprobs": _nested([np.frombuffer(r.logprobs, np.float32) for r in rows], np.float32),
            "routes": _nested(
                [
                    _NO_ROUTES32
                    if r.routes is None
                    else np.frombuffer(widen(r.routes, "int32").data, np.int32)
                    for r in rows
                ],
                np.int32,
            ),
            "sample_mask": torch.tensor([r.sample_mask for r in rows], dtype=torch.int64),
            "meta": _td.NonTensorStack(*meta),
        },
        batch_size=[len(rows)],
    )


def decode_rows(td: Any) -> list[TrainingRow]:
    """The training rows of a training-layout TensorDict, in row order."""
    ids, mask = _Column(td["input_ids"]), _Column(td["loss_mask"])
    logprobs, routes = _Column(td["logprobs"]), _Column(td["routes"])
    sample_mask = td["sample_mask"]
    sample_mask = (
        (sample_mask.values() if sample_mask.is_nested else sample_mask).reshape(-1).tolist()
    )
    out = []
    for i, raw in enumerate(_strings(td["meta"])):
        m = _json_decode(raw)
        shape = m.pop("routes")
        input_ids = array("I")
        input_ids.frombytes(ids.row(i).astype(np.uint32).data.cast("B"))
        spans = tuple(_span_from(span) for span in m.pop("call_spans"))
        media = m.pop("media", None)  # absent in rows written before rows named images
        out.append(
            TrainingRow(
                input_ids=input_ids,
                loss_mask=mask.array(i, "B"),
                logprobs=logprobs.array(i, "f"),
                routes=None if shape is None else _routes_from(routes.row(i), shape),
                call_spans=spans,
                sample_mask=int(sample_mask[i]),
                media=media_from_json(media) if media else (),
                **m,
            )
        )
    return out


def encode_media(blobs: Sequence[bytes]) -> Any:
    """A TensorDict of media blobs in the media layout (batch size ``len(blobs)``)."""
    return _td.TensorDict(
        {"blob": _nested([np.frombuffer(b, np.uint8) for b in blobs], np.uint8)},
        batch_size=[len(blobs)],
    )


def decode_media(td: Any) -> list[bytes]:
    """The media blobs of a media-layout TensorDict, in row order."""
    column = _Column(td["blob"])
    return [bytes(column.bytes[column.at[i] : column.at[i + 1]]) for i in range(len(column.at) - 1)]


def to_padded_batch(rows: Sequence[TrainingRow], pad_id: int) -> dict[str, Any]:
    """Right-padded torch tensors for a trainer step.

    Keys: ``input_ids`` int64 ``[B, T]`` (``pad_id`` past each row), ``attention_mask`` and
    ``loss_mask`` int64 ``[B, T]`` (0 on padding), ``logprobs`` float32 ``[B, T]`` (0.0 on
    padding), ``sample_mask`` int64 ``[B]``, and, when any row has routes, ``routes`` int32
    ``[B, T, L, K]`` (-1 on padding and for rows without routes; every row with routes must
    share ``L`` and ``K``). ``T`` is the longest row; an empty ``rows`` is a ``SinkError``.
    """
    if not rows:
        raise SinkError("empty_batch", "to_padded_batch needs at least one row")
    batch, width = len(rows), max(len(r.input_ids) for r in rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.int64)
    attention = torch.zeros((batch, width), dtype=torch.int64)
    loss_mask = torch.zeros((batch, width), dtype=torch.int64)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    kinds = {r.routes.shape[1:] for r in rows if r.routes is not None}
    if len(kinds) > 1:
        raise SinkError(
            "routes_mismatch", f"rows disagree on routes [layers, topk]: {sorted(kinds)}"
        )
    routes = None
    if kinds:
        layers, topk = kinds.pop()
        routes = torch.full((batch, width, layers, topk), -1, dtype=torch.int32)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[b, :n] = torch.from_numpy(
            np.frombuffer(row.input_ids, np.uint32).astype(np.int64)
        )
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.from_numpy(np.frombuffer(row.loss_mask, np.uint8).astype(np.int64))
        logprobs[b, :n] = torch.from_numpy(np.frombuffer(row.logprobs, np.float32).copy())
        if routes is not None and row.routes is not None:
            wide = np.frombuffer(widen(row.routes, "int32").data, np.int32).reshape(n, layers, topk)
            routes[b, :n] = torch.from_numpy(wide.copy())
    out = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "sample_mask": torch.tensor([r.sample_mask for r in rows], dtype=torch.int64),
    }
    if routes is not None:
        out["routes"] = routes
    return out
