"""Staged calls and training rows <-> the TensorDict layout TransferQueue stores.

Every variable-length column is a jagged nested tensor (one component per key); scalar
metadata rides in one JSON string column, ``meta``, so a row's key is always readable.

Staging partition (exact: the decoded call's digest verifies):
- ``tokens`` int32: the u32 token ids, bit for bit;
- ``logprobs`` float32;
- ``routes`` int16, flattened ``[S*L*K]`` (one ``-1`` word when the call has none: TQ cannot
  store an empty component): int8 ids widened
  by value, int16 as is, int32 bit-split into two int16 words; ``meta`` records the
  original dtype and shape, so decoding restores the very array the digest covers.

Training partition (trainer-ready): ``input_ids`` int64, ``loss_mask`` uint8, ``logprobs``
float32, ``routes`` int32 flattened (widened for NCCL, which has no int16; one ``-1`` when
none), ``sample_mask`` int64 per row; ``meta`` keeps the original routes dtype, so a
fetched `TrainingRow` equals the published one.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from tokcap_core import SinkError, StagedCall, TrainingRow
from tokcap_core.routes import Routes, widen
from tokcap_core.rows import CallSpan

from ._deps import np, torch
from ._deps import tensordict as _td

__all__ = [
    "STAGING_FIELDS",
    "TRAINING_FIELDS",
    "decode_rows",
    "decode_staged",
    "encode_rows",
    "encode_staged",
    "to_padded_batch",
]

STAGING_FIELDS = ("tokens", "logprobs", "routes", "meta")
TRAINING_FIELDS = ("input_ids", "loss_mask", "logprobs", "routes", "sample_mask", "meta")

_ROUTE_TYPECODE = {"int8": "b", "int16": "h", "int32": "i"}
_NP_DTYPE = {"int8": np.int8, "int16": np.int16, "int32": np.int32}
_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


def _jagged(parts: Sequence[Any], dtype: Any) -> Any:
    """One jagged nested tensor from per-row numpy arrays (empty rows allowed)."""
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    if not values.flags.writeable:
        values = values.copy()
    return torch.nested.nested_tensor_from_jagged(
        torch.from_numpy(values), torch.from_numpy(offsets)
    )


def _split(column: Any) -> tuple[Any, Any]:
    """``(values, offsets)`` numpy views of a jagged column."""
    if not getattr(column, "is_nested", False):
        raise SinkError("bad_layout", f"expected a jagged column, got {type(column).__name__}")
    return column.values().numpy(), column.offsets().numpy()


def _raw(values: Any) -> memoryview:
    """The bytes of a contiguous 1-D numpy array, without copying."""
    return memoryview(values).cast("B")


def _strings(column: Any) -> list[str]:
    return [s if isinstance(s, str) else str(s) for s in column]


def _routes_to_int16(routes: Routes) -> Any:
    data = np.frombuffer(routes.data, dtype=_NP_DTYPE[routes.dtype])
    return data.view(np.int16) if routes.dtype == "int32" else data.astype(np.int16)


def _routes_from_int16(words: Any, dtype: str, shape: list[int]) -> Routes:
    data = array(_ROUTE_TYPECODE[dtype])
    data.frombytes(_raw(words if dtype == "int32" else words.astype(_NP_DTYPE[dtype])))
    s, layers, topk = shape
    return Routes(dtype=dtype, shape=(s, layers, topk), data=data)


def _routes_meta(routes: Routes | None) -> list[Any] | None:
    return None if routes is None else [routes.dtype, *routes.shape]


# TQ's storage cannot serialise a zero-length component; ``meta`` says there are no routes.
_NO_ROUTES16 = np.full(1, -1, np.int16)
_NO_ROUTES32 = np.full(1, -1, np.int32)


def encode_staged(calls: Sequence[StagedCall]) -> Any:
    """A TensorDict of ``calls`` in the staging layout (batch size ``len(calls)``)."""
    meta = [
        _json_encode(
            {
                "rollout_id": c.rollout_id,
                "call_id": c.call_id,
                "parent_id": c.parent_id,
                "prefix_len": c.prefix_len,
                "carry_len": c.carry_len,
                "gen_len": c.gen_len,
                "weight_version": c.weight_version,
                "finish_reason": c.finish_reason,
                "digest": c.digest,
                "chain_hash": c.chain_hash,
                "routes": _routes_meta(c.routes),
            }
        ).decode()
        for c in calls
    ]
    return _td.TensorDict(
        {
            "tokens": _jagged([np.frombuffer(c.tokens, np.int32) for c in calls], np.int32),
            "logprobs": _jagged([np.frombuffer(c.logprobs, np.float32) for c in calls], np.float32),
            "routes": _jagged(
                [_NO_ROUTES16 if c.routes is None else _routes_to_int16(c.routes) for c in calls],
                np.int16,
            ),
            "meta": _td.NonTensorStack(*meta),
        },
        batch_size=[len(calls)],
    )


def decode_staged(td: Any) -> list[StagedCall]:
    """The staged calls of a staging-layout TensorDict, in row order."""
    tokens, tok_off = _split(td["tokens"])
    logprobs, lp_off = _split(td["logprobs"])
    routes, rt_off = _split(td["routes"])
    out = []
    for i, raw in enumerate(_strings(td["meta"])):
        m = _json_decode(raw)
        tok = array("I")
        tok.frombytes(_raw(tokens[tok_off[i] : tok_off[i + 1]]))
        lp = array("f")
        lp.frombytes(_raw(logprobs[lp_off[i] : lp_off[i + 1]]))
        shape = m.pop("routes")
        r = (
            None
            if shape is None
            else _routes_from_int16(routes[rt_off[i] : rt_off[i + 1]], shape[0], shape[1:])
        )
        out.append(StagedCall(tokens=tok, logprobs=lp, routes=r, **m))
    return out


def encode_rows(rows: Sequence[TrainingRow]) -> Any:
    """A TensorDict of ``rows`` in the training layout (routes widened to int32)."""
    meta = [
        _json_encode(
            {
                "rollout_id": r.rollout_id,
                "segment": r.segment,
                "prompt_len": r.prompt_len,
                "call_spans": [
                    [s.call_id, s.start, s.carry_len, s.gen_len, s.weight_version]
                    for s in r.call_spans
                ],
                "weight_version_min": r.weight_version_min,
                "weight_version_max": r.weight_version_max,
                "truncated": r.truncated,
                "reward": r.reward,
                "reason": r.reason,
                "terminal_call_id": r.terminal_call_id,
                "backfilled_route_rows": r.backfilled_route_rows,
                "routes": _routes_meta(r.routes),
            }
        ).decode()
        for r in rows
    ]
    return _td.TensorDict(
        {
            "input_ids": _jagged([np.frombuffer(r.input_ids, np.uint32) for r in rows], np.int64),
            "loss_mask": _jagged([np.frombuffer(r.loss_mask, np.uint8) for r in rows], np.uint8),
            "logprobs": _jagged([np.frombuffer(r.logprobs, np.float32) for r in rows], np.float32),
            "routes": _jagged(
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
    ids, id_off = _split(td["input_ids"])
    mask, mask_off = _split(td["loss_mask"])
    logprobs, lp_off = _split(td["logprobs"])
    routes, rt_off = _split(td["routes"])
    sample_mask = td["sample_mask"]
    sample_mask = (
        (sample_mask.values() if sample_mask.is_nested else sample_mask).reshape(-1).tolist()
    )
    out = []
    for i, raw in enumerate(_strings(td["meta"])):
        m = _json_decode(raw)
        input_ids = array("I")
        input_ids.frombytes(_raw(ids[id_off[i] : id_off[i + 1]].astype(np.uint32)))
        loss_mask = array("B")
        loss_mask.frombytes(_raw(mask[mask_off[i] : mask_off[i + 1]]))
        lp = array("f")
        lp.frombytes(_raw(logprobs[lp_off[i] : lp_off[i + 1]]))
        shape = m.pop("routes")
        r = None
        if shape is not None:
            data = array(_ROUTE_TYPECODE[shape[0]])
            data.frombytes(_raw(routes[rt_off[i] : rt_off[i + 1]].astype(_NP_DTYPE[shape[0]])))
            r = Routes(dtype=shape[0], shape=(shape[1], shape[2], shape[3]), data=data)
        spans = tuple(
            CallSpan(call_id=c, start=s, carry_len=cl, gen_len=gl, weight_version=wv)
            for c, s, cl, gl, wv in m.pop("call_spans")
        )
        out.append(
            TrainingRow(
                input_ids=input_ids,
                loss_mask=loss_mask,
                logprobs=lp,
                routes=r,
                call_spans=spans,
                sample_mask=int(sample_mask[i]),
                **m,
            )
        )
    return out


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
