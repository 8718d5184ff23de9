"""Engine-free parts of weight pushes to served gates: the guarded route list against vLLM's
own routers, the gate's weight tracker, the push file and the backend's registration."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tokcap_vllm import Gate
from tokcap_vllm.api import WEIGHTS_PATH
from tokcap_vllm.control._guarded_routes import GUARDED_PATHS, guarded_path
from tokcap_vllm.control._served_weights import ServedWeights
from tokcap_vllm.errors import GateError
from tokcap_vllm.transfer._shm import PushFile, read_push_file, write_push_file
from tokcap_vllm.weights import WeightPhase

VLLM_ROUTERS = [
    "vllm.entrypoints.rl.online.api_router",
    "vllm.entrypoints.serve.dev.cache.api_router",
    "vllm.entrypoints.serve.dev.rpc.api_router",
    "vllm.entrypoints.serve.dev.server_info.api_router",
    "vllm.entrypoints.serve.dev.sleep.api_router",
    "vllm.entrypoints.serve.elastic_ep.api_router",
    "vllm.entrypoints.serve.profile.api_router",
    "vllm.entrypoints.serve.fault_tolerance.api_router",
]


@pytest.mark.parametrize("module", VLLM_ROUTERS)
def test_every_route_of_vllms_rl_dev_and_admin_routers_is_guarded(module: str) -> None:
    router = importlib.import_module(module).router
    paths = {route.path for route in router.routes}
    assert paths, module
    assert paths <= GUARDED_PATHS, sorted(paths - GUARDED_PATHS)


@pytest.mark.parametrize(
    ("path", "root", "guarded"),
    [
        ("/pause", "", "/pause"),
        ("/pause/", "", "/pause"),
        ("//collective_rpc", "", "/collective_rpc"),
        ("/api/sleep", "/api", "/sleep"),
        ("/scale_elastic_ep", "", "/scale_elastic_ep"),
        (WEIGHTS_PATH + "/hold", "", WEIGHTS_PATH + "/hold"),
        ("/v1/chat/completions", "", None),
        ("/health", "", None),
        ("/pauses", "", None),
    ],
)
def test_a_guarded_route_is_recognised_however_its_path_is_spelled(
    path: str, root: str, guarded: str | None
) -> None:
    assert guarded_path({"path": path, "root_path": root}) == guarded


def test_the_tracker_is_ready_only_after_a_finish_that_loaded_and_labelled() -> None:
    weights = ServedWeights(version=0)
    seen: list[WeightPhase] = []
    weights.subscribe(lambda state: seen.append(state.phase))
    weights.started("0")
    assert weights.state.phase is WeightPhase.PUSHING
    weights.finished("0")  # an empty finish (nothing updated) loads nothing: still pushing
    assert weights.state.phase is WeightPhase.PUSHING
    weights.updated()
    weights.finished("3")
    assert (weights.state.phase, weights.state.version) == (WeightPhase.READY, 3)
    assert seen == [WeightPhase.PUSHING, WeightPhase.READY]


def test_a_push_keeps_kv_until_running_requests_are_reset_and_the_gate_learns_which() -> None:
    weights = ServedWeights(version=0)
    gate = Gate()
    gate.watch_weights(weights)  # type: ignore[arg-type]
    weights.started("0")
    weights.updated()
    weights.finished("1")
    assert weights.state.kv_kept  # until the push's KV reset comes
    assert gate.capture.kv_kept == {1}
    weights.recomputed()  # /reset_prefix_cache?reset_running_requests=true: mode recompute
    assert not weights.state.kv_kept
    assert gate.capture.kv_kept == set()
    weights.started("1")  # mode keep: no reset before the next push
    weights.updated()
    weights.finished("2")
    weights.started("2")
    weights.updated()
    weights.finished("3")
    weights.recomputed()
    assert gate.capture.kv_kept == {2}


def test_a_finish_without_a_label_is_ready_once_the_label_is_set() -> None:
    weights = ServedWeights(version=1)
    weights.started("1")
    weights.updated()
    weights.finished("1")
    assert weights.state.phase is WeightPhase.PUSHING
    weights.labelled("2")
    assert (weights.state.phase, weights.state.version) == (WeightPhase.READY, 2)


def test_a_failed_route_fails_the_weights_until_a_full_push() -> None:
    weights = ServedWeights()
    weights.started("0")
    weights.failed("update_failed")
    assert (weights.state.phase, weights.state.error) == (WeightPhase.FAILED, "update_failed")
    weights.finished("0")  # the empty finish that clears vLLM's flag changes nothing
    weights.labelled("7")
    assert weights.state.phase is WeightPhase.FAILED
    weights.started("0")
    weights.updated()
    weights.finished("1")
    assert (weights.state.phase, weights.state.version) == (WeightPhase.READY, 1)


def test_a_hold_outlives_the_gates_own_push_and_lifts_only_when_released() -> None:
    weights = ServedWeights()
    weights.hold("gate b failed")
    assert weights.state.phase is WeightPhase.FAILED
    weights.started("0")
    weights.updated()
    weights.finished("1")
    assert weights.state.phase is WeightPhase.FAILED
    assert weights.engine_phase == "READY"
    weights.release()
    assert (weights.state.phase, weights.state.version) == (WeightPhase.READY, 1)


def test_a_hold_is_not_released_over_a_failed_engine() -> None:
    weights = ServedWeights()
    weights.failed("finish_failed")
    weights.hold("fleet")
    with pytest.raises(GateError) as refused:
        weights.release()
    assert refused.value.code == "weights_not_ready"
    assert weights.held == "fleet"


def test_a_push_file_reads_back_as_the_same_tensors(tmp_path: Path) -> None:
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]
    spec = {"a": ("float32", (3, 5)), "b": ("int64", (7,))}
    path, entries = write_push_file(tensors, str(tmp_path))
    read = dict(read_push_file(path, entries, spec)[0])
    assert torch.equal(read["a"], tensors[0][1])
    assert torch.equal(read["b"], tensors[1][1])


def test_a_push_file_is_rewritten_in_place_and_read_into_the_workers_own_buffer(
    tmp_path: Path,
) -> None:
    spec = {"a": ("float32", (3, 5))}
    push = PushFile(str(tmp_path))
    path, entries = push.write([("a", torch.zeros(3, 5))])
    read = dict(read_push_file(path, entries, spec)[0])
    assert push.write([("a", torch.ones(3, 5))])[0] == path  # same file, pages reused
    assert torch.equal(read["a"], torch.zeros(3, 5))  # a copy: the rewrite is not seen
    assert torch.equal(dict(read_push_file(path, entries, spec)[0])["a"], torch.ones(3, 5))
    path, entries = push.write([("a", torch.full((3, 5), 2.0)), ("b", torch.arange(3))])
    assert Path(path).stat().st_size == entries[-1][3] + entries[-1][4]  # resized
    push.remove()
    assert not Path(path).exists()
    assert push.write([("a", torch.ones(3, 5))])[0] != path  # a new file after remove
    push.remove()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e[0].__setitem__(0, "c"), "unknown tensor"),
        (lambda e: e[0].__setitem__(2, [5, 3]), "expects float32"),
        (lambda e: e[1].__setitem__(1, "int32"), "expects int64"),
        (lambda e: e[1].__setitem__(3, 10_000), "do not fit"),
        (lambda e: e.append(list(e[0])), "twice"),
    ],
)
def test_the_worker_refuses_entries_that_are_not_the_spec(
    tmp_path: Path, edit: object, message: str
) -> None:
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]
    spec = {"a": ("float32", (3, 5)), "b": ("int64", (7,))}
    path, entries = write_push_file(tensors, str(tmp_path))
    edit(entries)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        read_push_file(path, entries, spec)


def test_the_worker_maps_only_push_files(tmp_path: Path) -> None:
    other = tmp_path / "secrets.bin"
    other.write_bytes(bytes(60))
    with pytest.raises(ValueError, match="not a tokcap push file"):
        read_push_file(str(other), [["a", "float32", [3, 5], 0, 60]], {"a": ("float32", (3, 5))})


def test_the_backend_registers_once_however_often_the_plugin_runs() -> None:
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from tokcap_vllm.server._plugin import register_weight_transfer
    from tokcap_vllm.transfer import (
        TokcapShmTrainerWeightTransferEngine,
        TokcapShmWeightTransferEngine,
    )

    register_weight_transfer()
    register_weight_transfer()
    assert WeightTransferEngineFactory._registry["tokcap_shm"]() is TokcapShmWeightTransferEngine
    trainer = WeightTransferTrainerFactory._registry["tokcap_shm"]()
    assert trainer is TokcapShmTrainerWeightTransferEngine


def _guard() -> tuple[Any, Any]:
    from tokcap_core import CaptureConfig
    from tokcap_vllm import Gate, GateConfig
    from tokcap_vllm.control._control import ControlPlane
    from tokcap_vllm.control._guarded_routes import GuardedRoutes

    gate = Gate(GateConfig(capture=CaptureConfig(control_token="secret-token")))
    return gate, GuardedRoutes(gate, ControlPlane(gate))


async def _call(guard: Any, path: str, token: str | None, app: Any) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
    await guard(scope, receive, send, app)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


def test_a_guarded_route_without_the_token_never_reaches_vllm() -> None:
    called: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope["path"])

    _, guard = _guard()
    for token in (None, "wrong"):
        status, body = anyio.run(_call, guard, "/collective_rpc", token, app)
        assert status == 401
        assert b"unauthorized" in body
    assert called == []


def test_a_vllm_weight_route_that_raises_is_answered_and_fails_the_weights() -> None:
    """vLLM's weight routes raise on a failed RPC; answered here, the client's connection
    survives (it carries the empty finish that clears vLLM's flag) and the gate knows."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("Worker failed with error 'a push carries every tensor'")

    _gate, guard = _guard()
    status, body = anyio.run(_call, guard, "/finish_weight_update", "secret-token", app)
    assert status == 500
    assert b"engine_route_failed" in body
    assert b"a push carries every tensor" in body
    assert guard.weights.state.phase is WeightPhase.FAILED
    assert guard.weights.state.error == "finish_failed"


def test_the_tracker_moves_before_a_weight_routes_answer_leaves() -> None:
    """A client sends its next route as soon as it reads an answer; the tracker must already
    hold that answer's effect (else a finish can overtake its update's count and the gate
    stays PUSHING: CI once failed on exactly that)."""
    from types import SimpleNamespace

    label = ["3"]

    async def get_weight_version() -> str:
        return label[0]

    engine = SimpleNamespace(get_weight_version=get_weight_version)
    vllm_app = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
    _gate, guard = _guard()
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/finish_weight_update":
            label[0] = "7"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def drive() -> None:
        for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):

            async def send(message: dict[str, Any], path: str = path) -> None:
                if message["type"] == "http.response.start":
                    seen[path] = guard.weights.state

            headers = [(b"authorization", b"Bearer secret-token")]
            scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
            scope["app"] = vllm_app
            await guard(scope, _empty_receive, send, app)

    anyio.run(drive)
    assert seen["/start_weight_update"].phase is WeightPhase.PUSHING
    finished = seen["/finish_weight_update"]
    assert (finished.phase, finished.version) == (WeightPhase.READY, 7)


async def _empty_receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}
