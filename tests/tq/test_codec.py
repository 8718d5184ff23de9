"""The TensorDict layout TQSink stores: exact round trips, and which decoder checks what
(no cluster needed)."""

from __future__ import annotations

import dataclasses
import json
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tq.support import rows_of
from tokcap_core import SinkError, StagedCall
from tokcap_core.errors import InvalidStagedCall
from tokcap_core.routes import Routes
from tokcap_core.simulate import simulate_rollout
from tokcap_core.testing import simulated_rollouts
from tokcap_tq import decode_rows, decode_staged, encode_rows, encode_staged
from tokcap_tq._codec import decode_own_staged


def _with_meta(td: object, edit: object) -> object:
    """``td`` with every row's ``meta`` JSON passed through ``edit`` (a dict -> dict)."""
    from tensordict import NonTensorStack

    metas = [json.dumps(edit(json.loads(m))) for m in td["meta"]]  # type: ignore[index, operator]
    td["meta"] = NonTensorStack(*metas)  # type: ignore[index]
    return td


@settings(max_examples=25, deadline=None)
@given(st.lists(simulated_rollouts(max_turns=3, max_roots=2), min_size=1, max_size=3))
def test_staged_calls_come_back_equal_through_both_decoders(rollouts: list[object]) -> None:
    calls = [c for r in rollouts for c in r.calls]  # type: ignore[attr-defined]
    td = encode_staged(calls)
    assert decode_staged(td) == calls
    assert decode_own_staged(td) == calls


_TYPECODE = {"int8": "b", "int16": "h", "int32": "i"}


def _as(routes: Routes, dtype: str) -> Routes:
    """The same expert ids held in ``dtype`` (the simulator's ids fit every dtype)."""
    return Routes(dtype=dtype, shape=routes.shape, data=array(_TYPECODE[dtype], routes.data))


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_routes_of_every_dtype_survive_the_int16_staging_column(dtype: str) -> None:
    calls = [
        dataclasses.replace(c, routes=_as(c.routes, dtype))
        for c in simulate_rollout("routes", seed=3, turns=3, routes=True).calls
        if c.routes is not None
    ]
    assert calls
    td = encode_staged(calls)
    assert str(td["routes"].dtype) == "torch.int16"
    for decode in (decode_staged, decode_own_staged):
        got = decode(td)
        assert got == calls
        assert [c.routes.dtype for c in got if c.routes] == [dtype] * len(calls)


@settings(max_examples=15, deadline=None)
@given(simulated_rollouts(max_turns=3, max_roots=2))
def test_training_rows_come_back_equal(rollout: object) -> None:
    rows = rows_of(rollout)  # type: ignore[arg-type]
    assert decode_rows(encode_rows(rows)) == rows


def test_the_public_decoder_checks_every_call_and_the_sinks_own_trusts_its_writes() -> None:
    (call, *_) = simulate_rollout("trust", seed=1, turns=1).calls

    def bad_length(meta: dict[str, object]) -> dict[str, object]:
        return meta | {"gen_len": 99}

    with pytest.raises(InvalidStagedCall):
        decode_staged(_with_meta(encode_staged([call]), bad_length))
    # The sink reads back only what it wrote from checked calls; verification recomputes
    # digests before training, and this one no longer matches.
    (trusted,) = decode_own_staged(_with_meta(encode_staged([call]), bad_length))
    assert isinstance(trusted, StagedCall)
    assert trusted.compute_digest() != trusted.digest


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: {k: v for k, v in m.items() if k != "weight_version_last"},
        lambda m: m | {"from_the_future": 1},
    ],
    ids=["a field missing", "an unknown field"],
)
def test_the_sinks_decoder_refuses_rows_of_another_layout(edit: object) -> None:
    (call, *_) = simulate_rollout("layout", seed=2, turns=1).calls
    with pytest.raises(SinkError) as info:
        decode_own_staged(_with_meta(encode_staged([call]), edit))
    assert info.value.code == "bad_layout"


_SPAN_VALUE = st.one_of(
    st.integers(min_value=-2, max_value=6), st.booleans(), st.none(), st.text(max_size=1)
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.none(),
        st.lists(st.lists(_SPAN_VALUE, min_size=2, max_size=4), max_size=3),
        st.lists(st.lists(st.integers(min_value=0, max_value=9), min_size=3, max_size=3)),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    )
)
def test_both_decoders_read_spans_with_the_same_checks(value: object) -> None:
    """Decoding a row's spans skips ``VersionSpan``'s constructor, not one of its checks:
    whatever `spans_from_json` refuses (``bad_spans``) is refused, the rest comes back equal."""
    from tokcap_core.provenance import spans_from_json
    from tokcap_tq._codec import _spans

    def read(reader: object) -> object:
        try:
            return reader(value)  # type: ignore[operator]
        except InvalidStagedCall as e:
            return e.code

    assert read(_spans) == read(spans_from_json)


def test_media_items_survive_both_decoders_and_older_rows_read_without_them() -> None:
    """Format v4 calls keep their media items through the staging layout; a row written
    before format v4 (no ``media`` in its meta) reads as a call without media."""
    from tokcap_core.golden import shipped_vectors
    from tokcap_core.staged import decode_staged_calls

    (case,) = [r for r in shipped_vectors()["rollouts"] if r["name"] == "images-two-turns"]
    calls = decode_staged_calls(json.dumps({"format": "tokcap/staged/v4", "calls": case["staged"]}))
    assert all(c.media for c in calls)
    assert decode_staged(encode_staged(calls)) == calls
    assert decode_own_staged(encode_staged(calls)) == calls
    plain = [dataclasses.replace(c, media=None) for c in calls]
    old = _with_meta(encode_staged(plain), lambda m: {k: v for k, v in m.items() if k != "media"})
    assert decode_own_staged(old) == plain


def test_rows_keep_their_images_and_media_blobs_come_back_bit_for_bit() -> None:
    from tests.core.test_media import item
    from tokcap_tq._codec import decode_media, encode_media

    (row,) = rows_of(simulate_rollout("media-row", seed=3, turns=1))
    with_image = dataclasses.replace(row, media=(item(offset=0, length=1),))
    assert decode_rows(encode_rows([with_image, row])) == [with_image, row]
    blobs = [b"TKMEDIA1" + bytes(range(256)), b"\x00"]
    assert decode_media(encode_media(blobs)) == blobs
