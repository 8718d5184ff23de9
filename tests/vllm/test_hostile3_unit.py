"""Engine-free checks of the issue #33 fixes the engine's side owns (breaks 2, 7, 8; Q2,
Q3, Q4, Q6); the served-gate cases are in test_hostile3.py."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
import torch

from tokcap_core import CaptureConfig
from tokcap_vllm import Gate, GateConfig
from tokcap_vllm.api import WEIGHTS_PATH, WeightSpec
from tokcap_vllm.control._control import ControlPlane
from tokcap_vllm.control._guarded_routes import MAX_PENDING_UPLOADS, GuardedRoutes
from tokcap_vllm.control._served_weights import ServedWeights
from tokcap_vllm.gate._gate import GateHealth
from tokcap_vllm.transfer._shm import (
    PushFile,
    check_push_file,
    read_push_file,
    unchanged_since,
    write_push_file,
)
from tokcap_vllm.transfer._weight_state import check_version, version_of_label
from tokcap_vllm.weights import GateWeightClient, WeightPhase, WeightPushError

TOKEN = "secret-token"
SPEC = {"a": ("float32", (3, 5)), "b": ("int64", (7,))}


def _tensors() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]


def _code(call: Any, *args: Any) -> str:
    with pytest.raises(WeightPushError) as refused:
        call(*args)
    return refused.value.code


# ---- break 2, Q3: one rule for versions and their labels ------------------------------------


@pytest.mark.parametrize(
    "label",
    ["abc", "-5", "1e3", "0x10", " 7", "7 ", "\u00b2", "07", "", "+7", "9223372036854775808"],
)
def test_q3_a_label_that_is_not_a_versions_own_spelling_is_bad_version(label: str) -> None:
    assert _code(version_of_label, label) == "bad_version"


def test_q3_a_versions_own_spelling_reads_as_that_version() -> None:
    assert [version_of_label(s) for s in ("0", "7", str(2**63 - 1))] == [0, 7, 2**63 - 1]
    for value in (2**63, -1, True, 7.0, "7", None):
        assert _code(check_version, value) == "bad_version"


def test_q3_a_served_gate_takes_only_labels_above_its_version() -> None:
    weights = ServedWeights(version=3)
    assert _code(weights.check_label, "0") == "version_not_increasing"  # backwards
    assert _code(weights.check_label, "3") == "version_not_increasing"
    assert _code(weights.check_label, "9223372036854775808") == "bad_version"
    assert weights.check_label("4") == 4
    assert weights.state.version == 3  # asking changes nothing


def test_b2_the_served_client_refuses_2_63_before_sending_anything() -> None:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    async def push() -> str:
        async with GateWeightClient(
            "http://gate", TOKEN, http=httpx.MockTransport(record)
        ) as client:
            with pytest.raises(WeightPushError) as refused:
                await client.push({}, 2**63)
            return refused.value.code

    assert anyio.run(push) == "bad_version"
    assert sent == []


# ---- the guarded routes ask the rules before vLLM sees a request -----------------------------


def _guard(tmp_path: Path, version: int = 3) -> tuple[GuardedRoutes, list[bytes], Any]:
    gate = Gate(GateConfig(capture=CaptureConfig(control_token=TOKEN)))
    guard = GuardedRoutes(gate, ControlPlane(gate), upload_dir=str(tmp_path))
    guard.weights = ServedWeights(version=version)
    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    spec = WeightSpec(tensors={n: (d, list(s)) for n, (d, s) in SPEC.items()}, tied=[])

    async def get_weight_version() -> str:
        return str(guard.weights.state.version)

    async def is_sleeping() -> bool:
        return False

    engine = SimpleNamespace(get_weight_version=get_weight_version, is_sleeping=is_sleeping)
    state = SimpleNamespace(engine_client=engine, tokcap_weight_spec=spec)
    return guard, bodies, SimpleNamespace(app=app, state=state)


def _call(
    guard: GuardedRoutes, vllm: Any, path: str, body: bytes, method: str = "POST"
) -> tuple[int, dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    scope = {"type": "http", "path": path, "method": method, "headers": headers, "app": vllm}
    anyio.run(guard, scope, receive, send, vllm.app)
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    import json

    return sent[0]["status"], json.loads(answer)


@pytest.mark.parametrize(
    ("path", "field", "label", "code"),
    [
        ("/update_weight_version", "new_version", str(2**63), "bad_version"),
        ("/update_weight_version", "new_version", "abc", "bad_version"),
        ("/update_weight_version", "new_version", "\u00b2", "bad_version"),
        ("/update_weight_version", "new_version", "0", "version_not_increasing"),
        ("/update_weight_version", "new_version", 9, "bad_version"),
        ("/finish_weight_update", "weight_version", str(2**63), "bad_version"),
        ("/finish_weight_update", "weight_version", " 7", "bad_version"),
    ],
)
def test_b2_q3_a_label_the_rule_refuses_never_reaches_vllm(
    tmp_path: Path, path: str, field: str, label: object, code: str
) -> None:
    guard, bodies, vllm = _guard(tmp_path)
    status, answer = _call(guard, vllm, path, f'{{"{field}": {_json(label)}}}'.encode())
    assert (status, answer["error"]["code"]) == (422, code)
    assert bodies == []
    assert (guard.weights.state.phase, guard.weights.state.version) == (WeightPhase.READY, 3)


def _json(value: object) -> str:
    import json

    return json.dumps(value)


def test_q3_a_good_label_reaches_vllm_with_its_body_unchanged(tmp_path: Path) -> None:
    guard, bodies, vllm = _guard(tmp_path)
    body = b'{"new_version": "4"}'
    assert _call(guard, vllm, "/update_weight_version", body)[0] == 200
    assert bodies == [body]


def test_q6_collective_rpc_is_refused_even_with_the_token(tmp_path: Path) -> None:
    guard, bodies, vllm = _guard(tmp_path)
    for method in ("__init__", "sleep", "reload_weights"):
        body = f'{{"method": "{method}"}}'.encode()
        status, answer = _call(guard, vllm, "/collective_rpc", body)
        assert (status, answer["error"]["code"]) == (403, "route_refused")
    assert bodies == []


def test_q6_an_engine_put_to_sleep_refuses_captured_calls_until_awake() -> None:
    weights = ServedWeights(version=2)
    weights.slept(1)
    assert (weights.state.phase, weights.state.error) == (WeightPhase.FAILED, "asleep")
    weights.woke()
    assert weights.state.serving
    weights.slept(2)  # the weights were discarded: a full push, not a wake-up, leaves FAILED
    weights.woke()
    assert (weights.state.phase, weights.state.error) == (
        WeightPhase.FAILED,
        "slept_discarding_weights",
    )


def test_q4_uploads_waiting_for_a_finish_are_bounded(tmp_path: Path) -> None:
    guard, _, vllm = _guard(tmp_path)
    paths = []
    for _ in range(MAX_PENDING_UPLOADS + 3):
        status, answer = _call(guard, vllm, WEIGHTS_PATH + "/upload", bytes(64), "PUT")
        assert status == 200
        paths.append(answer["path"])
    assert sorted(str(p) for p in tmp_path.iterdir()) == sorted(paths[-MAX_PENDING_UPLOADS:])


# ---- break 7: what a push file may be ---------------------------------------------------------


def _refusal(path: str, entries: Any) -> str:
    return _code(check_push_file, path, entries, SPEC)


def test_b7_a_link_named_like_a_push_file_is_refused_without_following_it(
    tmp_path: Path,
) -> None:
    path, entries = write_push_file(_tensors(), str(tmp_path))
    link = tmp_path / "tokcap-push-link"
    link.symlink_to(path)  # even to a good push file: the name check resolves nothing
    assert _refusal(str(link), entries) == "push_file_link"
    torch_lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    (tmp_path / "tokcap-push-lib").symlink_to(torch_lib)
    assert _refusal(str(tmp_path / "tokcap-push-lib"), entries) == "push_file_link"
    check_push_file(path, entries, SPEC)  # the file itself is fine


def test_b7_a_fifo_device_directory_or_hard_link_is_refused_without_blocking(
    tmp_path: Path,
) -> None:
    path, entries = write_push_file(_tensors(), str(tmp_path))
    fifo = tmp_path / "tokcap-push-fifo"
    os.mkfifo(fifo)  # nobody writes it: an open for reading would block
    assert _refusal(str(fifo), entries) == "push_file_not_regular"
    (tmp_path / "tokcap-push-dir").mkdir()
    assert _refusal(str(tmp_path / "tokcap-push-dir"), entries) == "push_file_not_regular"
    os.link(path, tmp_path / "tokcap-push-hard")
    assert _refusal(str(tmp_path / "tokcap-push-hard"), entries) == "push_file_linked"


def test_b7_a_push_file_of_another_size_or_name_is_refused(tmp_path: Path) -> None:
    path, entries = write_push_file(_tensors(), str(tmp_path))
    assert _refusal(os.path.relpath(path), entries) == "push_file_name"
    other = tmp_path / "weights.bin"
    other.write_bytes(Path(path).read_bytes())
    assert _refusal(str(other), entries) == "push_file_name"
    assert _refusal(str(tmp_path / "tokcap-push-none"), entries) == "push_file_missing"
    with open(path, "ab") as f:
        f.write(b"\0")
    assert _refusal(path, entries) == "push_file_size"


# ---- break 8: a push file that shrinks under the push ----------------------------------------


def test_b8_a_push_file_shrunk_after_it_was_read_harms_nothing_and_fails_the_finish(
    tmp_path: Path,
) -> None:
    """With the file mapped, reading the tensors after the truncate killed the process
    (SIGBUS); read into the worker's own buffer, the bytes stay, and the finish's check says
    the file changed under the push."""
    tensors = _tensors()
    push = PushFile(str(tmp_path))
    path, entries = push.write(tensors)
    views, buffer = read_push_file(path, entries, SPEC)
    assert buffer is not None
    os.truncate(path, 0)
    assert torch.equal(dict(views)["a"], tensors[0][1])  # touches every byte of "a"
    assert _code(unchanged_since, path, buffer.identity) == "push_file_changed"
    path, entries = push.write(tensors)  # the next good push reads again
    views, again = read_push_file(path, entries, SPEC)
    assert again is not None
    unchanged_since(path, again.identity)
    push.remove()


# ---- Q2: health says what stops or stalls captured calls -------------------------------------


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({}, "ok"),
        ({"engine": "unknown"}, "ok"),
        ({"sink_problem": "no TransferQueue on the cluster"}, "degraded"),
        ({"engine": "paused"}, "degraded"),
        ({"engine": "asleep"}, "degraded"),
        ({"engine": "unresponsive"}, "degraded"),
        ({"weights": "FAILED: finish_failed"}, "degraded"),
        ({"weights": "PUSHING"}, "ok"),
        ({"serving": False, "engine": "paused"}, "down"),
    ],
)
def test_q2_health_is_degraded_by_the_sink_the_weights_and_the_engine(
    change: dict[str, Any], status: str
) -> None:
    given: dict[str, Any] = {
        "serving": True,
        "rollouts_open": 0,
        "rollouts_closed": 0,
        "ledger_problem": None,
        "engine": "running",
        **change,
    }
    assert GateHealth(**given).status == status
