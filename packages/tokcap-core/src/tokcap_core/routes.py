"""Routed experts: a span's MoE routes as a small-int array, and their wire envelope.

Routes for ``S`` tokens are a C-order array shaped ``[S][L][K]`` (tokens, layers, top-k)
of expert ids, ``-1`` meaning unknown. They travel as the text envelope
``nrlre1:<int8|int16|int32>:<S>x<L>x<K>:<base64 of little-endian C-order bytes>``.
Decoding is strict: an envelope has exactly one accepted spelling, so
``encode_routes(decode_routes(e)) == e`` for every ``e`` that decodes.

A row (one token's ``[L][K]`` block) that is all ``-1`` is *unknown*: an engine never
reports a route for the last token it generated, so per-call routes are aligned with
:func:`align_routes`, chained with :func:`concat_routes`, and rows a later call re-read
are filled in with :func:`backfill_missing_rows`.
"""

from __future__ import annotations

import base64
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from tokcap_core._errors import RoutesError

__all__ = [
    "ENVELOPE_PREFIX",
    "UNKNOWN_EXPERT",
    "Routes",
    "align_routes",
    "backfill_missing_rows",
    "concat_routes",
    "decode_routes",
    "dtype_for_experts",
    "encode_routes",
    "routes_from_rows",
    "unknown_routes",
    "unknown_rows",
    "widen",
]

ENVELOPE_PREFIX = "nrlre1"
UNKNOWN_EXPERT = -1


def _signed_typecode(itemsize: int) -> str:
    # 'i' is 4 bytes on every platform CPython supports, but the envelope must not depend on it.
    for code in ("b", "h", "i", "l", "q"):
        if array(code).itemsize == itemsize:
            return code
    raise ImportError(f"no signed array typecode with itemsize {itemsize}")  # pragma: no cover


_TYPECODES: dict[str, str] = {
    "int8": _signed_typecode(1),
    "int16": _signed_typecode(2),
    "int32": _signed_typecode(4),
}
_MAX_ID: dict[str, int] = {"int8": 2**7 - 1, "int16": 2**15 - 1, "int32": 2**31 - 1}
_SWAP_BYTES = sys.byteorder == "big"  # the wire is little-endian; swap only on big-endian hosts
_DIM = re.compile(r"0|[1-9][0-9]{0,18}")  # no sign, no leading zeros, ASCII digits only


@dataclass(frozen=True, slots=True, kw_only=True)
class Routes:
    """Expert ids of ``shape = (tokens, layers, topk)``, flat in C order in ``data``.

    ``data`` is an ``array.array`` (typecode of ``dtype``), so torch/numpy can view it
    zero-copy through the buffer protocol. It is not copied: do not mutate it afterwards.
    """

    dtype: str
    shape: tuple[int, int, int]
    data: array[int]

    def __post_init__(self) -> None:
        typecode = _TYPECODES.get(self.dtype)
        if typecode is None:
            raise RoutesError("bad_dtype", f"dtype must be one of {sorted(_TYPECODES)}")
        if not isinstance(self.data, array) or self.data.typecode != typecode:
            raise RoutesError("bad_dtype", f"data must be array({typecode!r}) for {self.dtype}")
        shape = self.shape
        if (
            not isinstance(shape, tuple)
            or len(shape) != 3
            or any(type(n) is not int for n in shape)
            or shape[0] < 0
            or shape[1] < 1
            or shape[2] < 1
        ):
            raise RoutesError(
                "bad_shape", f"shape must be (tokens>=0, layers>=1, topk>=1): {shape}"
            )
        if len(self.data) != shape[0] * shape[1] * shape[2]:
            raise RoutesError("length_mismatch", f"{len(self.data)} values for shape {shape}")
        if self.data and min(self.data) < UNKNOWN_EXPERT:
            raise RoutesError("negative_expert", "expert ids are >= 0, or -1 for unknown")

    @property
    def tokens(self) -> int:
        """Number of token rows (``shape[0]``)."""
        return self.shape[0]


def dtype_for_experts(num_experts: int) -> str:
    """The smallest dtype holding expert ids ``0..num_experts-1``.

    Pass it to :func:`routes_from_rows` so every call of a model shares one dtype.
    """
    if num_experts < 1:
        raise RoutesError("expert_out_of_range", f"num_experts must be >= 1: {num_experts}")
    for dtype, top in _MAX_ID.items():
        if num_experts - 1 <= top:
            return dtype
    raise RoutesError("expert_out_of_range", f"{num_experts} experts do not fit int32")


def encode_routes(routes: Routes) -> str:
    """The ``nrlre1`` envelope of ``routes`` (little-endian, C order, standard base64)."""
    data = routes.data
    if _SWAP_BYTES:
        data = array(data.typecode, data)
        data.byteswap()
    s, layers, topk = routes.shape
    payload = base64.b64encode(data.tobytes()).decode("ascii")
    return f"{ENVELOPE_PREFIX}:{routes.dtype}:{s}x{layers}x{topk}:{payload}"


def decode_routes(envelope: str, *, max_bytes: int = 1 << 30) -> Routes:
    """Parse an ``nrlre1`` envelope; any deviation raises :class:`RoutesError`.

    Codes: ``bad_envelope`` (prefix, version, field count), ``bad_dtype``, ``bad_shape``,
    ``too_large`` (declared or sent payload over ``max_bytes``), ``bad_base64`` (invalid or
    non-canonical base64), ``length_mismatch``, ``negative_expert``.
    """
    if not isinstance(envelope, str):
        raise RoutesError("bad_envelope", f"envelope must be str, not {type(envelope).__name__}")
    parts = envelope.split(":")
    if len(parts) != 4 or parts[0] != ENVELOPE_PREFIX:
        raise RoutesError("bad_envelope", f"expected '{ENVELOPE_PREFIX}:<dtype>:<SxLxK>:<b64>'")
    _, dtype, shape_text, payload = parts
    typecode = _TYPECODES.get(dtype)
    if typecode is None:
        raise RoutesError("bad_dtype", f"unknown dtype {dtype[:16]!r}")
    dims = shape_text.split("x")
    if len(dims) != 3 or not all(_DIM.fullmatch(d) for d in dims):
        raise RoutesError("bad_shape", f"shape must be <S>x<L>x<K>: {shape_text[:64]!r}")
    s, layers, topk = (int(d) for d in dims)
    if layers < 1 or topk < 1:
        raise RoutesError("bad_shape", f"layers and topk must be >= 1: {shape_text!r}")
    expected = s * layers * topk * array(typecode).itemsize
    if expected > max_bytes or len(payload) > 4 * ((max_bytes + 2) // 3):
        raise RoutesError("too_large", f"routes of {expected} bytes exceed {max_bytes}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except ValueError as e:  # binascii.Error, or non-ASCII text
        raise RoutesError("bad_base64", str(e)) from None
    if base64.b64encode(raw).decode("ascii") != payload:
        raise RoutesError("bad_base64", "non-canonical base64 (padding or trailing bits)")
    if len(raw) != expected:
        raise RoutesError("length_mismatch", f"{len(raw)} bytes, shape needs {expected}")
    data = array(typecode)
    data.frombytes(raw)
    if _SWAP_BYTES:
        data.byteswap()
    return Routes(dtype=dtype, shape=(s, layers, topk), data=data)


def routes_from_rows(
    rows: Sequence[Sequence[Sequence[int]]], *, dtype: str | None = None
) -> Routes:
    """Routes from nested ints ``rows[token][layer][k]`` (an engine's per-token output).

    ``dtype=None`` picks the smallest dtype that fits the largest id in ``rows``; prefer
    ``dtype_for_experts(num_experts)`` so a chain's calls agree. An id the dtype cannot
    hold raises ``expert_out_of_range`` (never wrapped); ragged or empty ``rows`` raise
    ``bad_shape`` (use :func:`unknown_routes` for zero tokens); a non-integer id ``bad_value``.
    """
    if dtype is not None and dtype not in _TYPECODES:
        raise RoutesError("bad_dtype", f"dtype must be one of {sorted(_TYPECODES)}")
    flat: list[int] = []
    try:
        layers, topk = len(rows[0]), len(rows[0][0])
        for token, row in enumerate(rows):
            if len(row) != layers or any(len(experts) != topk for experts in row):
                raise RoutesError("bad_shape", f"row {token} is not [{layers}][{topk}]")
            for experts in row:
                flat.extend(experts)
    except (IndexError, TypeError):
        raise RoutesError("bad_shape", "rows must be non-empty [tokens][layers][topk]") from None
    if layers < 1 or topk < 1:
        raise RoutesError("bad_shape", "layers and topk must be >= 1")
    try:
        low, high = min(flat), max(flat)
    except TypeError:
        raise RoutesError("bad_value", "expert ids must be integers") from None
    if low < UNKNOWN_EXPERT:
        raise RoutesError("negative_expert", f"expert id {low} (only -1 means unknown)")
    if dtype is None:
        dtype = dtype_for_experts(max(high, 0) + 1)
    elif high > _MAX_ID[dtype]:
        raise RoutesError("expert_out_of_range", f"expert id {high} does not fit {dtype}")
    try:
        data = array(_TYPECODES[dtype], flat)
    except TypeError:
        raise RoutesError("bad_value", "expert ids must be integers") from None
    return Routes(dtype=dtype, shape=(len(rows), layers, topk), data=data)


def unknown_routes(tokens: int, *, layers: int, topk: int, dtype: str) -> Routes:
    """Routes of ``tokens`` rows that are all unknown (-1)."""
    if dtype not in _TYPECODES:
        raise RoutesError("bad_dtype", f"dtype must be one of {sorted(_TYPECODES)}")
    if tokens < 0 or layers < 1 or topk < 1:
        raise RoutesError("bad_shape", f"bad shape ({tokens}, {layers}, {topk})")
    data = array(_TYPECODES[dtype], [UNKNOWN_EXPERT]) * (tokens * layers * topk)
    return Routes(dtype=dtype, shape=(tokens, layers, topk), data=data)


def align_routes(routes: Routes, *, tokens: int) -> tuple[Routes, int]:
    """Pad an engine's routes to ``tokens`` rows with unknown rows at the end.

    Engines report ``tokens - 1`` rows (the last generated token is never fed back), so
    this pads exactly one row then, none if ``routes`` already has ``tokens`` rows.
    Returns ``(aligned, padded_rows)``; any other row count raises ``length_mismatch``.
    """
    missing = tokens - routes.tokens
    if missing not in (0, 1):
        raise RoutesError(
            "length_mismatch",
            f"{routes.tokens} route rows for {tokens} tokens (want it or one less)",
        )
    if missing == 0:
        return routes, 0
    _, layers, topk = routes.shape
    pad = unknown_routes(missing, layers=layers, topk=topk, dtype=routes.dtype)
    return concat_routes([routes, pad]), missing


def _check_same_kind(first: Routes, other: Routes) -> None:
    if first.shape[1:] != other.shape[1:]:
        raise RoutesError(
            "chain_shape_mismatch",
            f"[layers, topk] {list(other.shape[1:])} != {list(first.shape[1:])}",
        )
    if first.dtype != other.dtype:
        raise RoutesError("chain_dtype_mismatch", f"dtype {other.dtype} != {first.dtype}")


def concat_routes(parts: Sequence[Routes]) -> Routes:
    """Join routes along tokens (a chain's calls, root first).

    Every part must share ``[layers, topk]`` (``chain_shape_mismatch``) and dtype
    (``chain_dtype_mismatch``; :func:`widen` first if needed). Empty ``parts`` → ``bad_shape``.
    """
    if not parts:
        raise RoutesError("bad_shape", "cannot concatenate zero routes (layers/topk unknown)")
    first = parts[0]
    data = array(first.data.typecode)
    for part in parts:
        _check_same_kind(first, part)
        data.extend(part.data)
    _, layers, topk = first.shape
    return Routes(dtype=first.dtype, shape=(len(data) // (layers * topk), layers, topk), data=data)


def _row_bytes(routes: Routes) -> int:
    _, layers, topk = routes.shape
    return layers * topk * routes.data.itemsize


def unknown_rows(routes: Routes) -> tuple[int, ...]:
    """Indices of the rows that are entirely -1 (unknown), ascending."""
    width = _row_bytes(routes)
    unknown = b"\xff" * width  # -1 is all one-bits in two's complement, whatever the byte order
    view = memoryview(routes.data).cast("B")
    return tuple(t for t in range(routes.tokens) if view[t * width : (t + 1) * width] == unknown)


def backfill_missing_rows(
    routes: Routes, source: Routes, rows: Sequence[int]
) -> tuple[Routes, int]:
    """Fill unknown rows of ``routes`` from the same row index of ``source``.

    For each index in ``rows``, a row that is all -1 in ``routes`` and not all -1 in
    ``source`` is copied from ``source``; any other row is left alone. Both arrays are
    indexed in the same token coordinates (e.g. the chain's full sequence, with ``source``
    holding the next call's prefill routes at the positions it re-read). Returns
    ``(new_routes, rows_filled)``; ``routes`` itself is unchanged.
    Codes: ``chain_shape_mismatch``, ``chain_dtype_mismatch``, ``row_out_of_range``.
    """
    _check_same_kind(routes, source)
    limit = min(routes.tokens, source.tokens)
    if any(not 0 <= t < limit for t in rows):
        raise RoutesError("row_out_of_range", f"rows must lie in [0, {limit})")
    targets = set(unknown_rows(routes)).intersection(rows)
    fills = sorted(targets.difference(unknown_rows(source)))
    if not fills:
        return routes, 0
    width = routes.shape[1] * routes.shape[2]
    data = array(routes.data.typecode, routes.data)
    for t in fills:
        data[t * width : (t + 1) * width] = source.data[t * width : (t + 1) * width]
    return Routes(dtype=routes.dtype, shape=routes.shape, data=data), len(fills)


def widen(routes: Routes, dtype: str = "int32") -> Routes:
    """The same routes in a dtype at least as wide (e.g. int16 → int32 for NCCL).

    Narrowing raises ``bad_dtype``; the same dtype returns ``routes`` itself.
    """
    if dtype not in _TYPECODES:
        raise RoutesError("bad_dtype", f"dtype must be one of {sorted(_TYPECODES)}")
    if _MAX_ID[dtype] < _MAX_ID[routes.dtype]:
        raise RoutesError("bad_dtype", f"cannot narrow {routes.dtype} to {dtype}")
    if dtype == routes.dtype:
        return routes
    return Routes(dtype=dtype, shape=routes.shape, data=array(_TYPECODES[dtype], routes.data))
