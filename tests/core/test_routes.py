"""Routed experts: envelope round trips, strict decoding, and chain alignment/backfill."""

from __future__ import annotations

import base64
import pickle
import sys
from array import array
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import routes as routes_module
from tokcap_core.errors import RoutesError
from tokcap_core.routes import (
    Routes,
    align_routes,
    backfill_missing_rows,
    concat_routes,
    decode_routes,
    dtype_for_experts,
    encode_routes,
    routes_from_rows,
    unknown_routes,
    unknown_rows,
    widen,
)

TOP = {"int8": 127, "int16": 32767, "int32": 2**31 - 1}
TYPECODE = {"int8": "b", "int16": "h", "int32": "i"}
SIZE = {"int8": 1, "int16": 2, "int32": 4}


@st.composite
def routes_st(
    draw: st.DrawFn, *, dtype: str | None = None, shape: tuple[int, int, int] | None = None
) -> Routes:
    dtype = dtype or draw(st.sampled_from(sorted(TOP)))
    s, layers, topk = shape or (
        draw(st.integers(0, 5)),
        draw(st.integers(1, 4)),
        draw(st.integers(1, 3)),
    )
    values = draw(
        st.lists(
            st.integers(-1, TOP[dtype]), min_size=s * layers * topk, max_size=s * layers * topk
        )
    )
    return Routes(dtype=dtype, shape=(s, layers, topk), data=array(TYPECODE[dtype], values))


def rows_of(routes: Routes) -> list[list[list[int]]]:
    s, layers, topk = routes.shape
    flat = routes.data.tolist()
    return [
        [flat[(t * layers + la) * topk : (t * layers + la + 1) * topk] for la in range(layers)]
        for t in range(s)
    ]


def raises(code: str) -> pytest.RaisesExc[RoutesError]:
    return pytest.raises(RoutesError, match=rf"^\[{code}\]")


# --- envelope ---------------------------------------------------------------------------


@given(routes_st())
def test_decode_inverts_encode(routes: Routes) -> None:
    assert decode_routes(encode_routes(routes)) == routes


@given(routes_st())
def test_encode_inverts_decode(routes: Routes) -> None:
    envelope = encode_routes(routes)
    assert encode_routes(decode_routes(envelope)) == envelope


@given(routes_st())
def test_wire_bytes_are_little_endian_c_order(routes: Routes) -> None:
    payload = encode_routes(routes).rsplit(":", 1)[1]
    want = b"".join(v.to_bytes(SIZE[routes.dtype], "little", signed=True) for v in routes.data)
    assert base64.b64decode(payload) == want


def test_big_endian_host_swaps_to_and_from_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a little-endian host, pretending to be big-endian must byteswap on both sides:
    # the bytes come out big-endian here (proving the swap runs) and still round-trip.
    routes = routes_from_rows([[[1, 258]], [[-1, 300]]], dtype="int16")
    monkeypatch.setattr(routes_module, "_SWAP_BYTES", not routes_module._SWAP_BYTES)
    envelope = encode_routes(routes)
    swapped: Literal["little", "big"] = "big" if sys.byteorder == "little" else "little"
    want = b"".join(v.to_bytes(2, swapped, signed=True) for v in (1, 258, -1, 300))
    assert base64.b64decode(envelope.rsplit(":", 1)[1]) == want
    assert decode_routes(envelope) == routes
    assert routes.data.tolist() == [1, 258, -1, 300]  # the caller's buffer is not swapped


def test_known_envelope() -> None:
    routes = routes_from_rows([[[0, 1], [2, -1]]])
    assert encode_routes(routes) == "nrlre1:int8:1x2x2:AAEC/w=="
    assert decode_routes("nrlre1:int32:0x3x2:") == unknown_routes(
        0, layers=3, topk=2, dtype="int32"
    )


@pytest.mark.parametrize(
    ("envelope", "code"),
    [
        ("nrlre2:int8:1x1x1:AA==", "bad_envelope"),
        ("NRLRE1:int8:1x1x1:AA==", "bad_envelope"),
        ("nrlre1:int8:1x1x1", "bad_envelope"),
        ("nrlre1:int8:1x1x1:AA==:", "bad_envelope"),
        ("", "bad_envelope"),
        ("nrlre1:uint8:1x1x1:AA==", "bad_dtype"),
        ("nrlre1:int64:1x1x1:AAAAAAAAAAA=", "bad_dtype"),
        ("nrlre1:int8:1x1:AA==", "bad_shape"),
        ("nrlre1:int8:1x1x1x1:AA==", "bad_shape"),
        ("nrlre1:int8:01x1x1:AA==", "bad_shape"),
        ("nrlre1:int8:-1x1x1:AA==", "bad_shape"),
        ("nrlre1:int8:+1x1x1:AA==", "bad_shape"),
        ("nrlre1:int8:1x1x\u0661:AA==", "bad_shape"),  # Arabic-Indic digit one
        ("nrlre1:int8:1x0x1:", "bad_shape"),
        ("nrlre1:int8:1x1x0:", "bad_shape"),
        ("nrlre1:int8: 1x1x1:AA==", "bad_shape"),
        ("nrlre1:int8:1x1x1:AA", "bad_base64"),
        ("nrlre1:int8:1x1x1:A A==", "bad_base64"),
        ("nrlre1:int8:1x1x1:AA==\n", "bad_base64"),
        ("nrlre1:int8:1x1x1:AB==", "bad_base64"),  # non-canonical trailing bits
        ("nrlre1:int8:1x1x1:AA\u00e9=", "bad_base64"),
        ("nrlre1:int8:2x1x1:AA==", "length_mismatch"),
        ("nrlre1:int16:1x1x1:AA==", "length_mismatch"),
        ("nrlre1:int8:1x1x1:/g==", "negative_expert"),  # -2
    ],
)
def test_decode_rejects(envelope: str, code: str) -> None:
    with raises(code):
        decode_routes(envelope)


def test_decode_rejects_non_str() -> None:
    with raises("bad_envelope"):
        decode_routes(b"nrlre1:int8:1x1x1:AA==")  # type: ignore[arg-type]


def test_too_large_is_refused_before_decoding() -> None:
    assert decode_routes("nrlre1:int16:2x1x1:AQACAA==", max_bytes=4).data.tolist() == [1, 2]
    with raises("too_large"):
        decode_routes("nrlre1:int16:2x1x1:AQACAA==", max_bytes=3)
    with raises("too_large"):  # a declared size no one could send
        decode_routes("nrlre1:int32:9999999999999999999x1x1:")
    with raises("too_large"):  # a payload far beyond the limit, whatever the shape says
        decode_routes("nrlre1:int8:1x1x1:" + "A" * 400, max_bytes=8)


# --- Routes and routes_from_rows -------------------------------------------------------


def test_routes_validates_itself() -> None:
    with raises("bad_dtype"):
        Routes(dtype="int64", shape=(1, 1, 1), data=array("q", [0]))
    with raises("bad_dtype"):
        Routes(dtype="int16", shape=(1, 1, 1), data=array("b", [0]))
    with raises("bad_shape"):
        Routes(dtype="int8", shape=(1, 0, 1), data=array("b"))
    with raises("bad_shape"):
        Routes(dtype="int8", shape=(1, 1), data=array("b", [0]))  # type: ignore[arg-type]
    with raises("length_mismatch"):
        Routes(dtype="int8", shape=(2, 1, 1), data=array("b", [0]))
    with raises("negative_expert"):
        Routes(dtype="int8", shape=(1, 1, 1), data=array("b", [-2]))


def test_routes_are_zero_copy_and_picklable() -> None:
    routes = routes_from_rows([[[3, 4]]], dtype="int32")
    view = memoryview(routes.data)
    assert (view.format, view.itemsize, view.tolist()) == ("i", 4, [3, 4])
    assert pickle.loads(pickle.dumps(routes)) == routes


@given(routes_st())
def test_rows_round_trip(routes: Routes) -> None:
    if routes.tokens:
        assert routes_from_rows(rows_of(routes), dtype=routes.dtype) == routes


@pytest.mark.parametrize(
    ("top", "dtype"),
    [
        (-1, "int8"),
        (127, "int8"),
        (128, "int16"),
        (32767, "int16"),
        (32768, "int32"),
        (2**31 - 1, "int32"),
    ],
)
def test_smallest_dtype_is_picked(top: int, dtype: str) -> None:
    assert routes_from_rows([[[top, -1]]]).dtype == dtype
    assert dtype_for_experts(max(top, 0) + 1) == dtype


def test_int8_overflow_is_rejected_not_wrapped() -> None:
    with raises("expert_out_of_range"):
        routes_from_rows([[[0, 300]]], dtype="int8")  # a 384-expert model into int8
    with raises("expert_out_of_range"):
        routes_from_rows([[[2**31]]])
    with raises("expert_out_of_range"):
        dtype_for_experts(0)
    with raises("expert_out_of_range"):
        dtype_for_experts(2**31 + 1)


@pytest.mark.parametrize(
    ("rows", "code"),
    [
        ([], "bad_shape"),
        ([[]], "bad_shape"),
        ([[[]]], "bad_shape"),
        ([[[1, 2]], [[1]]], "bad_shape"),
        ([[[1, 2]], [[1, 2], [3, 4]]], "bad_shape"),
        ([[1, 2]], "bad_shape"),
        ([[[1, -2]]], "negative_expert"),
        ([[[1.5, 2]]], "bad_value"),
        ([[[1, "2"]]], "bad_value"),
    ],
)
def test_routes_from_rows_rejects(rows: list[list[list[int]]], code: str) -> None:
    with raises(code):
        routes_from_rows(rows)


def test_bad_dtype_arguments() -> None:
    with raises("bad_dtype"):
        routes_from_rows([[[1]]], dtype="uint8")
    with raises("bad_dtype"):
        unknown_routes(1, layers=1, topk=1, dtype="int4")
    with raises("bad_shape"):
        unknown_routes(-1, layers=1, topk=1, dtype="int8")


# --- alignment, chains, backfill -------------------------------------------------------


def test_align_pads_exactly_one_unknown_row() -> None:
    engine = routes_from_rows([[[1, 2]], [[3, 4]]], dtype="int16")  # 2 rows for 3 tokens
    aligned, padded = align_routes(engine, tokens=3)
    assert padded == 1
    assert aligned.shape == (3, 1, 2)
    assert aligned.data.tolist() == [1, 2, 3, 4, -1, -1]
    assert unknown_rows(aligned) == (2,)
    assert align_routes(aligned, tokens=3) == (aligned, 0)
    empty = unknown_routes(0, layers=1, topk=2, dtype="int8")
    assert align_routes(empty, tokens=1)[1] == 1


@pytest.mark.parametrize("tokens", [0, 1, 4, 10])
def test_align_rejects_other_lengths(tokens: int) -> None:
    with raises("length_mismatch"):
        align_routes(routes_from_rows([[[1]], [[2]]]), tokens=tokens)


def test_concat_joins_along_tokens_and_checks_the_chain() -> None:
    a = routes_from_rows([[[1, 2]]], dtype="int16")
    b = routes_from_rows([[[3, 4]], [[-1, -1]]], dtype="int16")
    joined = concat_routes([a, b])
    assert joined.shape == (3, 1, 2)
    assert joined.data.tolist() == [1, 2, 3, 4, -1, -1]
    assert concat_routes([a]) == a
    with raises("chain_shape_mismatch"):
        concat_routes([a, routes_from_rows([[[1, 2, 3]]], dtype="int16")])
    with raises("chain_shape_mismatch"):
        concat_routes([a, routes_from_rows([[[1, 2], [3, 4]]], dtype="int16")])
    with raises("chain_dtype_mismatch"):
        concat_routes([a, routes_from_rows([[[1, 2]]], dtype="int8")])
    with raises("bad_shape"):
        concat_routes([])


def test_backfill_fills_only_unknown_rows_with_known_source_rows() -> None:
    # call 1 generated 2 tokens; its last row is unknown. Call 2's prefill re-read the
    # sequence and knows row 1 but not row 0 (so row 0 stays as call 1 had it).
    routes = routes_from_rows([[[5, 6]], [[-1, -1]], [[-1, -1]]], dtype="int8")
    source = routes_from_rows([[[7, 7]], [[8, 9]], [[-1, -1]]], dtype="int8")
    filled, count = backfill_missing_rows(routes, source, [0, 1, 2, 1])
    assert count == 1
    assert filled.data.tolist() == [5, 6, 8, 9, -1, -1]
    assert unknown_rows(filled) == (2,)
    assert routes.data.tolist() == [5, 6, -1, -1, -1, -1]  # input untouched
    assert backfill_missing_rows(routes, source, []) == (routes, 0)


def test_backfill_checks_kind_and_rows() -> None:
    routes = routes_from_rows([[[-1, -1]]], dtype="int8")
    with raises("chain_shape_mismatch"):
        backfill_missing_rows(routes, routes_from_rows([[[1]]], dtype="int8"), [0])
    with raises("chain_dtype_mismatch"):
        backfill_missing_rows(routes, routes_from_rows([[[1, 2]]], dtype="int16"), [0])
    with raises("row_out_of_range"):
        backfill_missing_rows(routes, routes_from_rows([[[1, 2]], [[3, 4]]], dtype="int8"), [1])
    with raises("row_out_of_range"):
        backfill_missing_rows(routes, routes, [-1])


@given(routes_st(), st.data())
def test_backfill_count_equals_unknown_rows_removed(routes: Routes, data: st.DataObject) -> None:
    source = data.draw(routes_st(dtype=routes.dtype, shape=routes.shape))
    rows = data.draw(st.lists(st.integers(0, max(routes.tokens - 1, 0)))) if routes.tokens else []
    filled, count = backfill_missing_rows(routes, source, rows)
    assert len(unknown_rows(routes)) - len(unknown_rows(filled)) == count


def test_widen() -> None:
    routes = routes_from_rows([[[1, -1]], [[300, 2]]], dtype="int16")
    wide = widen(routes)
    assert (wide.dtype, wide.shape, wide.data.tolist()) == ("int32", (2, 1, 2), [1, -1, 300, 2])
    assert memoryview(wide.data).itemsize == 4
    assert widen(routes, "int16") is routes
    with raises("bad_dtype"):
        widen(routes, "int8")
    with raises("bad_dtype"):
        widen(routes, "int64")
