"""RPC contract: requests and results carry metadata only, and validate on construction."""

from __future__ import annotations

import dataclasses
import pickle
from array import array
from collections import namedtuple
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import InvalidId, Receipt, assemble_receipt, verify_manifest
from tokcap_core.errors import MetadataViolation
from tokcap_core.rpc import (
    FORBIDDEN_KEYS,
    MAX_METADATA_DEPTH,
    FinalizedGroup,
    InvalidRequest,
    ReassemblyRequest,
    assert_metadata_only,
)
from tokcap_core.simulate import simulate_rollout


def receipt_of(rollout_id: str, *, seed: int = 0, **kwargs: Any) -> Receipt:
    sim = simulate_rollout(rollout_id, seed=seed, **kwargs)
    return assemble_receipt(verify_manifest(sim.manifest), segments="all")


IDS = ("g0-r0", "g0-r1", "g0-r2")
RECEIPTS = tuple(
    receipt_of(rid, seed=i, roots=2, offchain_failures=1, routes=True) for i, rid in enumerate(IDS)
)


def request(**overrides: Any) -> ReassemblyRequest:
    kwargs: dict[str, Any] = {
        "group_id": "g0",
        "rollout_ids": IDS,
        "receipts": RECEIPTS,
        "rewards": (1.0, None, -0.5),
        "max_seq_len": 4096,
    }
    return ReassemblyRequest(**(kwargs | overrides))


def finalized(**overrides: Any) -> FinalizedGroup:
    kwargs: dict[str, Any] = {
        "group_id": "g0",
        "rollout_ids": IDS,
        "valid_row_count": 2,
        "total_row_count": 3,
        "training_keys": ("train/g0/0", "train/g0/1", "train/g0/2"),
        "staging_keys": ("g0-r0/c000001", "g0-r1/c000001"),
        "staging_cleared": True,
        "weight_version_min": 1,
        "weight_version_max": 2,
        "failures": (("g0-r2", "stage_failed:timeout"),),
        "metrics": {"failures/stage_failed": 1.0},
    }
    return FinalizedGroup(**(kwargs | overrides))


# A new field must be classified as metadata (or refused) before it joins its set.
PINNED_FIELDS = [
    (ReassemblyRequest, "group_id rollout_ids receipts rewards max_seq_len clear_staging"),
    (
        FinalizedGroup,
        "group_id rollout_ids valid_row_count total_row_count training_keys staging_keys "
        "staging_cleared weight_version_min weight_version_max failures metrics outcome",
    ),
]


@pytest.mark.parametrize(("cls", "names"), PINNED_FIELDS)
def test_the_rpc_field_sets_are_pinned(cls: type, names: str) -> None:
    assert {f.name for f in dataclasses.fields(cls)} == set(names.split())


def test_a_realistic_request_passes_and_survives_pickle() -> None:
    req = request()
    assert pickle.loads(pickle.dumps(req)) == req
    assert_metadata_only(req)


def test_staging_keys_are_every_admitted_call_including_off_chain_ones() -> None:
    req = request()
    assert req.staging_keys == tuple(k for r in RECEIPTS for k in r.sink_keys)
    on_chain = {c.staging_key for r in RECEIPTS for seg in r.segments for c in seg}
    assert on_chain < set(req.staging_keys)


def test_a_finalized_group_survives_pickle_and_copies_its_metrics() -> None:
    metrics = {"a": 1.0}
    group = finalized(metrics=metrics)
    metrics["a"] = 2.0
    assert group.metrics == {"a": 1.0}
    assert pickle.loads(pickle.dumps(group)) == group


def test_valid_fraction_is_valid_over_total_and_zero_without_rows() -> None:
    assert finalized().valid_fraction == pytest.approx(2 / 3)
    unknown = finalized(
        outcome="unknown",
        valid_row_count=0,
        total_row_count=0,
        training_keys=(),
        weight_version_min=None,
        weight_version_max=None,
    )
    assert unknown.valid_fraction == 0.0
    assert unknown.valid_rollout_count == 2


@pytest.mark.parametrize("key", sorted(FORBIDDEN_KEYS))
def test_a_forbidden_key_is_refused_at_top_level(key: str) -> None:
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only({key: 1})
    assert e.value.code == "forbidden_key"


@dataclasses.dataclass
class Holder:
    payload: Any


@pytest.mark.parametrize("key", sorted(FORBIDDEN_KEYS))
def test_a_forbidden_key_is_refused_in_a_dict_in_a_list_in_a_dataclass(key: str) -> None:
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only(Holder(payload=[{"ok": 1}, {key: "x"}]))
    assert e.value.code == "forbidden_key"
    assert f"payload[1][{key!r}]" in str(e.value)


@pytest.mark.parametrize("key", sorted(FORBIDDEN_KEYS))
def test_a_forbidden_dataclass_field_name_is_refused(key: str) -> None:
    cls = dataclasses.make_dataclass("Leaky", [(key, int)])
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only([cls(1)])
    assert e.value.code == "forbidden_key"


def test_a_forbidden_namedtuple_field_is_refused() -> None:
    Pair = namedtuple("Pair", ["rollout_id", "tokens"])
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only(Pair("r", 1))
    assert e.value.code == "forbidden_key"


class FakeTensor:
    def __dlpack__(self) -> None: ...


class FakeNdarray:
    __array_interface__: dict[str, Any] = {}  # noqa: RUF012


class FakeCudaArray:
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        raise AssertionError("must not be evaluated")


class TrainingRow:
    """Stands in for tokcap's token-carrying row type (matched by name)."""


TENSORS = {
    "array": array("I", [1, 2]),
    "memoryview": memoryview(b"ab"),
    "bytes": b"ab",
    "bytearray": bytearray(b"ab"),
    "dlpack": FakeTensor(),
    "array_interface": FakeNdarray(),
    "cuda_array_interface": FakeCudaArray(),
    "training_row": TrainingRow(),
}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_tensors_and_buffers_are_refused_anywhere(name: str) -> None:
    value = TENSORS[name]
    for wrapped in (value, [value], {"meta": (value,)}, Holder(payload={"x": value})):
        with pytest.raises(MetadataViolation) as e:
            assert_metadata_only(wrapped)
        assert e.value.code == "tensor_value"


def test_staged_calls_and_routes_are_refused() -> None:
    call = simulate_rollout("r", seed=1, routes=True).calls[0]
    assert call.routes is not None
    for value in (call, call.routes):
        with pytest.raises(MetadataViolation) as e:
            assert_metadata_only({"meta": value})
        assert e.value.code == "tensor_value"


def test_the_path_names_where_the_violation_is() -> None:
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only(Holder(payload=[0, {"k": [1, 2, array("I")]}]))
    assert "payload[1]['k'][2]" in str(e.value)


@pytest.mark.parametrize("value", [len, object(), Holder, 1j, ...])
def test_other_objects_are_unsupported(value: object) -> None:
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only([value])
    assert e.value.code == "unsupported_type"


def test_nesting_deeper_than_the_limit_and_cycles_are_too_deep() -> None:
    nested: list[Any] = []
    for _ in range(MAX_METADATA_DEPTH + 1):
        nested = [nested]
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only(nested)
    assert e.value.code == "too_deep"
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(MetadataViolation) as e:
        assert_metadata_only(cycle)
    assert e.value.code == "too_deep"


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
metadata = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=8).filter(lambda k: k not in FORBIDDEN_KEYS), inner),
    ),
    max_leaves=20,
)


@given(metadata)
def test_plain_metadata_always_passes(value: object) -> None:
    assert_metadata_only(value)


def test_metadata_violation_is_a_type_error_and_picklable() -> None:
    with pytest.raises(TypeError) as e:
        assert_metadata_only(b"x")
    again = pickle.loads(pickle.dumps(e.value))
    assert isinstance(again, MetadataViolation)
    assert again.code == "tensor_value"


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"rewards": (1.0, 2.0)}, "length_mismatch"),
        ({"receipts": RECEIPTS[:2]}, "length_mismatch"),
        ({"rollout_ids": (IDS[0], IDS[0], IDS[1])}, "duplicate_rollout_id"),
        ({"rollout_ids": ()}, "bad_rollout_ids"),
        ({"rollout_ids": list(IDS)}, "bad_rollout_ids"),
        ({"receipts": (RECEIPTS[1], RECEIPTS[0], RECEIPTS[2])}, "receipt_mismatch"),
        ({"rewards": (1.0, float("nan"), 0.0)}, "bad_reward"),
        ({"rewards": (1.0, float("inf"), 0.0)}, "bad_reward"),
        ({"rewards": (1.0, True, 0.0)}, "bad_reward"),
        ({"max_seq_len": 0}, "bad_max_seq_len"),
        ({"clear_staging": 1}, "bad_field"),
    ],
)
def test_a_malformed_request_is_refused_with_its_code(overrides: dict[str, Any], code: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        request(**overrides)
    assert e.value.code == code
    assert isinstance(e.value, ValueError)


def test_ids_follow_the_rollout_id_grammar() -> None:
    with pytest.raises(InvalidId) as e:
        request(group_id="bad group")
    assert e.value.code == "bad_group_id"
    with pytest.raises(InvalidId) as e:
        finalized(group_id="")
    assert e.value.code == "bad_group_id"


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"valid_row_count": 4}, "bad_counts"),
        ({"total_row_count": 2}, "bad_counts"),
        ({"training_keys": ("a", "b"), "total_row_count": 2}, "bad_counts"),
        ({"valid_row_count": 3}, "bad_counts"),
        ({"training_keys": ("a", "a", "b")}, "duplicate_key"),
        ({"staging_keys": ("a", "a")}, "duplicate_key"),
        ({"weight_version_min": 3}, "bad_weight_versions"),
        ({"weight_version_max": None}, "bad_weight_versions"),
        ({"valid_row_count": 0}, "bad_weight_versions"),
        ({"failures": (("stranger", "x"),)}, "bad_failure"),
        ({"failures": (("g0-r2", "x"), ("g0-r2", "y"))}, "bad_failure"),
        ({"failures": (("g0-r2", ""),)}, "bad_failure"),
        ({"metrics": {"m": float("nan")}}, "bad_metric"),
        ({"metrics": {1: 1.0}}, "bad_metric"),
        ({"outcome": "maybe"}, "bad_outcome"),
        ({"staging_cleared": None}, "bad_field"),
    ],
)
def test_a_malformed_finalized_group_is_refused_with_its_code(
    overrides: dict[str, Any], code: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        finalized(**overrides)
    assert e.value.code == code


def test_metrics_with_a_forbidden_key_are_refused() -> None:
    with pytest.raises(MetadataViolation) as e:
        finalized(metrics={"tokens": 1.0})
    assert e.value.code == "forbidden_key"
