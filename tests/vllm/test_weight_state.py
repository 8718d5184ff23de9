"""The weight-push contract without an engine: state machine, checkpoint spec, push checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tokcap_vllm.client._weight_client import StagedPush, check_while_staging
from tokcap_vllm.transfer._shm import write_push_file as _write_file
from tokcap_vllm.transfer._weight_state import begin, fail, succeed
from tokcap_vllm.transfer._weights import _chunks
from tokcap_vllm.weights import (
    FleetWeightSync,
    WeightPhase,
    WeightPushError,
    WeightState,
    WeightSyncError,
    check_push,
    expected_spec,
    read_checkpoint_spec,
)

READY, PUSHING, FAILED = WeightPhase.READY, WeightPhase.PUSHING, WeightPhase.FAILED


# ---- the state machine ---------------------------------------------------------------------


def test_a_push_goes_ready_pushing_ready_at_the_new_version() -> None:
    state = WeightState(phase=READY, version=3)
    pushing = begin(state, 5)
    assert (pushing.phase, pushing.version, pushing.target, pushing.serving) == (
        PUSHING,
        3,
        5,
        False,
    )
    done = succeed(pushing)
    assert done == WeightState(phase=READY, version=5)
    assert done.serving


def test_a_failed_push_keeps_the_last_full_version_until_a_full_push_succeeds() -> None:
    failed = fail(begin(WeightState(phase=READY, version=3), 4), "commit_failed")
    assert failed == WeightState(phase=FAILED, version=3, target=4, error="commit_failed")
    assert not failed.serving
    retried = begin(failed, 4)  # the same version may be retried: 3 is the last one loaded
    assert succeed(retried) == WeightState(phase=READY, version=4)


@pytest.mark.parametrize(
    ("state", "op", "code"),
    [
        (WeightState(phase=READY, version=1), lambda s: succeed(s), "not_pushing"),
        (WeightState(phase=READY, version=1), lambda s: fail(s, "x"), "not_pushing"),
        (
            WeightState(phase=FAILED, version=1, target=2, error="x"),
            lambda s: succeed(s),
            "not_pushing",
        ),
        (
            WeightState(phase=FAILED, version=1, target=2, error="x"),
            lambda s: fail(s, "y"),
            "not_pushing",
        ),
        (
            WeightState(phase=PUSHING, version=1, target=2),
            lambda s: begin(s, 3),
            "push_in_progress",
        ),
        (WeightState(phase=READY, version=1), lambda s: begin(s, 1), "version_not_increasing"),
        (WeightState(phase=READY, version=1), lambda s: begin(s, 0), "version_not_increasing"),
        (WeightState(phase=READY, version=1), lambda s: begin(s, -2), "bad_version"),
        (WeightState(phase=READY, version=1), lambda s: begin(s, True), "bad_version"),
        (WeightState(phase=READY, version=1), lambda s: begin(s, "2"), "bad_version"),
    ],
)
def test_illegal_transitions_are_refused_with_a_stable_code(
    state: WeightState, op: object, code: str
) -> None:
    with pytest.raises(WeightPushError) as info:
        op(state)  # type: ignore[operator]
    assert info.value.code == code


OPS = st.lists(
    st.tuples(st.sampled_from(["begin", "succeed", "fail"]), st.integers(0, 6)), max_size=30
)


@given(OPS)
def test_any_sequence_of_operations_keeps_the_invariants(ops: list[tuple[str, int]]) -> None:
    state = WeightState(phase=READY, version=0)
    for op, arg in ops:
        before = state
        try:
            if op == "begin":
                state = begin(state, arg)
            elif op == "succeed":
                state = succeed(state)
            else:
                state = fail(state, "x")
        except WeightPushError:
            assert state is before  # a refusal changes nothing
            continue
        assert state.version >= before.version  # the full version only grows...
        if state.version != before.version:
            assert (before.phase, op, state.phase) == (PUSHING, "succeed", READY)  # ...on success
        assert state.serving == (state.phase is READY)
        if before.phase is FAILED:
            assert state.phase is PUSHING  # nothing but a new push leaves FAILED


# ---- the spec a push must match ------------------------------------------------------------


def write_safetensors(path: Path, header: dict[str, object]) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_the_spec_comes_from_the_headers_with_the_engine_dtype_and_the_tied_head(
    tmp_path: Path,
) -> None:
    write_safetensors(
        tmp_path / "model-00001.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "model.embed_tokens.weight": {
                "dtype": "BF16",
                "shape": [10, 4],
                "data_offsets": [0, 80],
            },
            "model.norm.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [80, 88]},
        },
    )
    write_safetensors(
        tmp_path / "model-00002.safetensors",
        {"model.step": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}},
    )
    checkpoint = read_checkpoint_spec(tmp_path)
    assert checkpoint == {
        "model.embed_tokens.weight": ("bfloat16", (10, 4)),
        "model.norm.weight": ("bfloat16", (4,)),
        "model.step": ("int64", ()),
    }
    spec, tied = expected_spec(checkpoint, dtype="float32", tie_word_embeddings=True)
    assert spec == {
        "model.embed_tokens.weight": ("float32", (10, 4)),
        "model.norm.weight": ("float32", (4,)),
        "model.step": ("int64", ()),
        "lm_head.weight": ("float32", (10, 4)),
    }
    assert tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    untied, none = expected_spec(checkpoint, dtype="float32", tie_word_embeddings=False)
    assert "lm_head.weight" not in untied
    assert none == ()
    # a vision-language model's text embedding (Idefics3's): the head is tied to it
    nested = {"model.text_model.embed_tokens.weight": ("bfloat16", (10, 4))}
    spec, tied = expected_spec(nested, dtype="float32", tie_word_embeddings=True)
    assert spec["lm_head.weight"] == ("float32", (10, 4))
    assert tied == (("lm_head.weight", "model.text_model.embed_tokens.weight"),)


def test_a_folder_without_safetensors_has_no_spec(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_checkpoint_spec(tmp_path)


SPEC = {"a.weight": ("float32", (2, 3)), "b.weight": ("float32", (3,)), "head": ("float32", (2, 3))}
TIED = (("head", "a.weight"),)


def full() -> dict[str, torch.Tensor]:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {"a.weight": a, "b.weight": torch.ones(3), "head": a}


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda w: w.pop("b.weight"), "missing_tensors"),
        (lambda w: w.pop("head"), "missing_tensors"),
        (lambda w: w.update(extra=torch.zeros(1)), "unknown_tensors"),
        (lambda w: w.update({"b.weight": torch.ones(4)}), "shape_mismatch"),
        (lambda w: w.update({"b.weight": torch.ones(3, dtype=torch.bfloat16)}), "dtype_mismatch"),
        (lambda w: w.update({"b.weight": torch.ones(3, dtype=torch.float64)}), "dtype_mismatch"),
        (lambda w: w.update({"b.weight": [1.0, 1.0, 1.0]}), "not_a_tensor"),
        (
            lambda w: w.update({"b.weight": torch.tensor([1.0, float("nan"), 1.0])}),
            "non_finite_weights",
        ),
        (lambda w: w.update(head=w["a.weight"] + 1), "tied_mismatch"),
    ],
)
def test_a_push_that_is_not_exactly_the_spec_is_refused(edit: object, code: str) -> None:
    weights = full()
    edit(weights)  # type: ignore[operator]
    with pytest.raises(WeightPushError) as info:
        check_push(weights, SPEC, tied=TIED)
    assert info.value.code == code


def test_a_full_push_passes_in_its_own_order_and_equal_tied_copies_are_fine() -> None:
    weights = full()
    weights["head"] = weights["a.weight"].clone()
    checked = check_push(weights, SPEC, tied=TIED)
    assert [name for name, _ in checked] == list(weights)
    assert all(t.is_contiguous() for _, t in checked)


def test_finite_weights_whose_sum_overflows_pass_the_check() -> None:
    weights = full()
    weights["b.weight"] = torch.full((3,), 3e38)  # finite; their float32 sum is inf
    assert [name for name, _ in check_push(weights, SPEC, tied=TIED)] == list(weights)
    weights["b.weight"] = torch.tensor([3e38, float("inf"), -3e38])
    with pytest.raises(WeightPushError) as info:
        check_push(weights, SPEC, tied=TIED)
    assert info.value.code == "non_finite_weights"


@pytest.mark.parametrize(
    ("values", "stage_fails", "expected"),
    [
        ([1.0, 2.0], False, None),
        ([1.0, float("nan")], False, "non_finite_weights"),
        ([1.0, float("nan")], True, "non_finite_weights"),  # the refusal wins
        ([1.0, 2.0], True, "stage_failed"),
    ],
)
def test_the_finite_check_run_while_staging_refuses_whatever_the_staging_did(
    values: list[float], stage_fails: bool, expected: str | None
) -> None:
    tensors = [("w", torch.tensor(values))]
    written: list[object] = []

    async def stage(ts: object) -> StagedPush:
        written.append(ts)
        if stage_fails:
            raise WeightSyncError("stage_failed", "disk full")
        return StagedPush("/dev/shm/tokcap-push-x", [], owned_here=True)

    async def main() -> StagedPush:
        return await check_while_staging(tensors, stage)

    if expected is None:
        assert anyio.run(main).path == "/dev/shm/tokcap-push-x"
    else:
        with pytest.raises((WeightPushError, WeightSyncError)) as info:
            anyio.run(main)
        assert info.value.code == expected
    assert written == [tensors]


def test_chunks_carry_the_raw_bytes_and_split_on_the_size_bound() -> None:
    tensors = [
        ("x", torch.arange(4, dtype=torch.float32)),
        ("y", torch.ones(2, 2, dtype=torch.bfloat16)),
        ("z", torch.zeros(0)),
    ]
    chunks = list(_chunks(tensors, chunk_bytes=16))
    assert [[entry[0] for entry in chunk] for chunk in chunks] == [["x"], ["y", "z"]]
    name, dtype, shape, data = chunks[1][0]
    assert (name, dtype, shape) == ("y", "bfloat16", [2, 2])
    assert bytes(data) == tensors[1][1].view(torch.uint8).numpy().tobytes()
    assert bytes(chunks[0][0][3]) == tensors[0][1].numpy().tobytes()


def test_the_shared_memory_file_holds_each_tensor_at_its_offset(tmp_path: Path) -> None:
    tensors = [("x", torch.arange(3, dtype=torch.int64)), ("y", torch.full((2,), 0.5))]
    path, entries = _write_file(tensors, str(tmp_path))
    blob = Path(path).read_bytes()
    assert entries == [["x", "int64", [3], 0, 24], ["y", "float32", [2], 64, 8]]
    padding = bytes(64 - 24)
    assert blob == tensors[0][1].numpy().tobytes() + padding + tensors[1][1].numpy().tobytes()
    assert Path(path).stat().st_mode & 0o077 == 0  # readable by this user only


# ---- a fleet that loses a gate ---------------------------------------------------------------


def test_a_fleet_drops_a_lost_gate_but_never_its_last() -> None:
    async def run() -> None:
        urls = ["http://gate-a:8000", "http://gate-b:8000/"]
        async with FleetWeightSync([(url, "t") for url in urls]) as fleet:
            with pytest.raises(WeightPushError) as unknown:
                await fleet.drop("http://gate-c:8000")
            assert unknown.value.code == "unknown_gate"
            await fleet.drop("http://gate-b:8000")
            assert [c.base_url for c in fleet.clients] == ["http://gate-a:8000"]
            with pytest.raises(WeightPushError) as last:
                await fleet.drop("http://gate-a:8000/")
            assert last.value.code == "no_gates"
            assert len(fleet.clients) == 1

    anyio.run(run)
