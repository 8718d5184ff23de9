"""Weights pushed by a trainer in another process into served gates (``tokcap-vllm serve``).

Two gates run as their own OS processes (the real CLI, ``VLLM_SERVER_DEV_MODE=1``,
``--weight-transfer-config '{"backend": "tokcap_shm"}'``); this test process is the trainer:
it holds the model in transformers, pushes with `GateWeightClient` / `FleetWeightSync`
over HTTP with the control token, and checks the engine against its own copy. The gates'
weights are pushed back to the original after each test that changes them.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from tokcap.compose import ServedGate
from tokcap_core import logprob_parity
from tokcap_core.ledger import Staged
from tokcap_core.provenance import VersionSpan
from tokcap_vllm import ControlPlaneClient
from tokcap_vllm.weights import (
    GUARDED_PATHS,
    FleetPushError,
    FleetWeightSync,
    GateWeightClient,
    WeightPushError,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "served-push-" + secrets.token_hex(12)
SAME = 1e-9
Weights = dict[str, torch.Tensor]
_IDS = itertools.count()
SERVE_ARGS = [
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
    "--max-model-len",
    "2048",
    "--dtype",
    "float32",
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens",
    "4096",
    "--weight-transfer-config",
    '{"backend": "tokcap_shm"}',
    "--tokcap-sink",
    "memory",
]


@pytest.fixture(scope="module")
def gates(tiny_model: Path, gate_logs: Path) -> Iterator[list[str]]:
    """Two ``tokcap-vllm serve`` processes on loopback (`tokcap.compose.ServedGate`: a port
    another process took before the gate bound it is swapped for another), started
    together; their base URLs.

    Gate 0 loads pushes directly (the default on CPU); gate 1 always through vLLM's
    layerwise reload (``TOKCAP_SHM_LOAD=layerwise``), so the fleet tests push both ways.
    """
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    started = [
        ServedGate(
            tiny_model,
            SERVE_ARGS,
            token=TOKEN,
            log=gate_logs / f"gate{i}.log",
            env={**env, "TOKCAP_SHM_LOAD": load},
        )
        for i, load in enumerate(("auto", "layerwise"))
    ]
    try:
        for gate in started:
            gate.wait_healthy(TOKEN, 900)
        yield [gate.url for gate in started]
    finally:
        for gate in started:
            gate.stop()


@pytest.fixture(scope="module")
def gate_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each gate's output goes (``gate0.log``, ``gate1.log``)."""
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def original(model: Any) -> Weights:
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


def perturbed(original: Weights, seed: int, scale: float = 0.05) -> Weights:
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: t + torch.randn(t.shape, generator=generator) * scale if t.is_floating_point() else t
        for name, t in original.items()
        if name != "lm_head.weight"
    }
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def run(coro_fn: Any, *args: Any) -> Any:
    return anyio.run(coro_fn, *args)


async def version_of(url: str) -> int:
    async with GateWeightClient(url, TOKEN) as c:
        return (await c.info()).version


async def push(url: str, weights: Weights, **kwargs: Any) -> Any:
    async with GateWeightClient(url, TOKEN, **kwargs) as c:
        return await c.push(weights, (await c.info()).version + 1)


def engine_parity(url: str, model: Any, weights: Weights, count: int = 3) -> float:
    """K3 of the engine's sampled-token logprobs against this process's recompute."""
    model.load_state_dict({k: v for k, v in weights.items()}, strict=False)
    engine, trainer, mask = [], [], []
    for seed in range(count):
        body = {
            "model": "m",
            "prompt": f"def f{seed}(x):",
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
        }
        answer = httpx.post(url + "/v1/completions", json=_named(url, body), timeout=120).json()
        choice = answer["choices"][0]
        prompt, output = answer["choices"][0]["prompt_token_ids"], choice["token_ids"]
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        recomputed = logits.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()
        engine.append(choice["logprobs"]["token_logprobs"])
        trainer.append(recomputed)
        mask.append([1] * len(output))
    return logprob_parity(engine, trainer, mask).k3


def last_load(gate_logs: Path, gate: int) -> str:
    """How the gate's engine loaded its last push, as its worker logged it."""
    lines = (gate_logs / f"gate{gate}.log").read_text(errors="replace").splitlines()
    loads = [line for line in lines if "tokcap_shm loaded" in line]
    assert loads, f"gate {gate} logged no load"
    return loads[-1]


def loaded_directly(line: str) -> bool:
    """The worker's line says: a direct load, every packed layer's weight a view of the push
    file (the trainer writes a fused layer's shards back to back)."""
    found = re.search(r"direct load: (\d+) packed layers \((\d+) from views of the file", line)
    return found is not None and int(found[1]) > 0 and found[1] == found[2]


def _named(url: str, body: dict[str, Any]) -> dict[str, Any]:
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {**body, "model": models[0]["id"]}


def captured(url: str) -> tuple[int, Any]:
    """One captured completion on a fresh rollout: the status, and its staged version (200)."""
    rollout = f"served-{next(_IDS)}"
    body = _named(url, {"prompt": "def g(x):", "max_tokens": 4, "temperature": 0})
    response = httpx.post(f"{url}/tokcap/rollouts/{rollout}/v1/completions", json=body, timeout=120)
    if response.status_code != 200:
        return response.status_code, response.json()["error"]["code"]

    async def staged_version() -> int:
        async with ControlPlaneClient(url, TOKEN) as control:
            await control.close(rollout, reward=0.0)
            manifest = await control.manifest(rollout)
        (event,) = [e.event for e in manifest.entries if isinstance(e.event, Staged)]
        return event.weight_version

    return 200, anyio.run(staged_version)


@pytest.fixture
def restore(gates: list[str], original: Weights) -> Iterator[None]:
    """Every gate back on the original weights, released, whatever the test did."""
    yield

    async def back() -> None:
        async with FleetWeightSync([(url, TOKEN) for url in gates]) as fleet:
            top = max(info.version for info in await fleet.infos())
            await fleet.push(original, top + 1)

    anyio.run(back)


# ---- the route guard --------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(GUARDED_PATHS | {"/tokcap/v1/weights/hold"}))
def test_every_rl_dev_and_admin_route_answers_401_without_the_token(
    gates: list[str], path: str
) -> None:
    url = gates[0]
    for method in ("GET", "POST"):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-tokcap-rollout-id": "r1"}):
            answer = httpx.request(method, url + path, headers=headers, json={}, timeout=30)
            assert answer.status_code == 401, (method, path, headers, answer.text)
            assert answer.json()["error"]["code"] == "unauthorized"
    slashed = httpx.post(url + path + "/", timeout=30)
    assert slashed.status_code == 401


def test_with_the_token_vllms_routes_answer(gates: list[str]) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    info = httpx.get(gates[0] + "/weight_info", headers=auth, timeout=30)
    assert info.status_code == 200
    assert "weight_version" in info.json()
    assert httpx.get(gates[0] + "/is_paused", headers=auth, timeout=30).json() == {
        "is_paused": False
    }


# ---- one gate ---------------------------------------------------------------------------


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize("transport", ["shm", "http"])
def test_a_push_from_another_process_lands_exactly(
    gates: list[str], gate_logs: Path, model: Any, original: Weights, transport: str
) -> None:
    url = gates[0]
    assert engine_parity(url, model, original) <= SAME
    new = perturbed(original, seed=1 if transport == "shm" else 2)
    # Other processes on the host (the suite's other lane) push too: only this push's files count.
    before = set(Path("/dev/shm").glob("tokcap-push-*"))
    info = run(lambda: push(url, new, transport=transport))
    assert (info.phase, info.engine_version) == ("READY", str(info.version))
    assert loaded_directly(last_load(gate_logs, 0))  # not vLLM's layerwise reload
    assert engine_parity(url, model, new) <= SAME  # vs the trainer's copy, fresh prefix cache
    assert engine_parity(url, model, original) > 1e-4  # the engine really moved
    assert captured(url) == (200, info.version)  # the native version, per staged call
    assert set(Path("/dev/shm").glob("tokcap-push-*")) <= before  # this push left none


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_push_while_a_served_call_generates_is_recorded_span_by_span(
    gates: list[str], original: Weights, mode: str
) -> None:
    """A streamed captured completion; after its 8th chunk another process pushes in
    ``mode``. The served gate learns from the routes it guards whether the running KV was
    reset: ``recompute`` gives KV spans equal to the weight spans, ``keep`` leaves the tokens
    after the push on the old weights' KV."""
    url = gates[0]
    rollout = f"served-span-{mode}-{next(_IDS)}"
    new = perturbed(original, seed=5 if mode == "keep" else 6)

    async def scenario() -> tuple[int, Staged]:
        body = _named(
            url,
            {"prompt": "a long story:", "max_tokens": 1000, "temperature": 1.0,
             "ignore_eos": True, "stream": True},
        )  # fmt: skip
        pushed: list[int] = []

        async def push_in_flight() -> None:
            async with GateWeightClient(url, TOKEN, mode=mode) as c:  # type: ignore[arg-type]
                info = await c.push(new, (await c.info()).version + 1)
            pushed.append(info.version)

        target = f"{url}/tokcap/rollouts/{rollout}/v1/completions"
        async with (
            anyio.create_task_group() as tg,
            httpx.AsyncClient(timeout=300) as http,
            http.stream("POST", target, json=body) as answer,
        ):
            chunks = 0
            async for _ in answer.aiter_lines():
                chunks += 1
                if chunks == 8:
                    tg.start_soon(push_in_flight)
        async with ControlPlaneClient(url, TOKEN) as control:
            await control.close(rollout, reward=0.0)
            manifest = await control.manifest(rollout)
        (event,) = [e.event for e in manifest.entries if isinstance(e.event, Staged)]
        return pushed[0], event

    version, event = anyio.run(scenario)
    spans = event.weight_versions or ()
    assert [s.version for s in spans] == [version - 1, version]
    assert (spans[0].start, spans[-1].end) == (0, 1000)
    if mode == "recompute":
        assert event.kv_versions == spans
    else:
        assert event.kv_versions == (VersionSpan(version=version - 1, start=0, end=1000),)


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda w: w.pop("lm_head.weight"), "missing_tensors"),
        (lambda w: w.update({"model.norm.weight": torch.ones(3)}), "shape_mismatch"),
        (lambda w: w.update({"extra.weight": torch.ones(3)}), "unknown_tensors"),
        (
            lambda w: w.update({"model.norm.weight": w["model.norm.weight"].double()}),
            "dtype_mismatch",
        ),
        (
            lambda w: w.update({"model.norm.weight": w["model.norm.weight"] * float("nan")}),
            "non_finite_weights",
        ),
    ],
)
def test_a_bad_push_is_refused_before_the_gate_sees_it(
    gates: list[str], model: Any, original: Weights, edit: Any, code: str
) -> None:
    url = gates[0]
    before = run(version_of, url)
    weights = dict(original)
    edit(weights)
    with pytest.raises(WeightPushError) as refused:
        run(lambda: push(url, weights))
    assert refused.value.code == code
    assert run(version_of, url) == before
    assert captured(url)[0] == 200
    assert engine_parity(url, model, original) <= SAME


def test_a_version_that_does_not_increase_is_refused(gates: list[str], original: Weights) -> None:
    async def stale() -> None:
        async with GateWeightClient(gates[0], TOKEN) as c:
            await c.push(original, (await c.info()).version)

    with pytest.raises(WeightPushError) as refused:
        run(stale)
    assert refused.value.code == "version_not_increasing"


@pytest.mark.usefixtures("restore")
def test_a_push_the_worker_refuses_leaves_the_gate_failed_until_a_full_push(
    gates: list[str], model: Any, original: Weights
) -> None:
    """vLLM's own routes, driven with a partial push (what a foreign trainer could send):
    the worker refuses at finish, the gate refuses captured calls, a full push recovers."""
    url = gates[0]
    auth = {"authorization": f"Bearer {TOKEN}"}

    async def partial() -> tuple[int, int]:
        async with (
            GateWeightClient(url, TOKEN) as c,  # its push file lives as long as the client
            httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as h,
        ):
            tensors = await c.check(original)
            staged = await c.stage(tensors[:-1])
            await h.post("/pause", params={"mode": "wait"})
            await h.post("/start_weight_update")
            info = {"update_info": {"path": staged.path, "entries": staged.entries}}
            updated = await h.post("/update_weights", json=info)
            finished = await h.post("/finish_weight_update", json={"weight_version": "99"})
            await h.post("/resume")
        return updated.status_code, finished.status_code

    assert run(partial) == (200, 500)
    assert captured(url) == (503, "weights_unavailable")
    new = perturbed(original, seed=3)
    info = run(lambda: push(url, new))  # its start clears the flag the failed finish left
    assert info.phase == "READY"
    assert captured(url) == (200, info.version)
    assert engine_parity(url, model, new) <= SAME


@pytest.mark.usefixtures("restore")
def test_vllms_own_trainer_engine_factory_pushes_through_the_registered_backend(
    gates: list[str], model: Any, original: Weights
) -> None:
    """Trainer code written against vLLM's API (`WeightTransferTrainerFactory`) runs on CPU:
    the backend resolves to tokcap's, the bearer client gets through the guard."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from tokcap_vllm.server._plugin import register_weight_transfer
    from tokcap_vllm.transfer import (
        BearerWeightSyncClient,
        StateDictSource,
        TokcapShmTrainerInitInfo,
    )

    register_weight_transfer()  # in a trainer process no vLLM plugin loader runs
    url = gates[0]
    new = perturbed(original, seed=5)
    engine = WeightTransferTrainerFactory.trainer_init(
        TokcapShmTrainerInitInfo(rank=0),
        client=BearerWeightSyncClient(url, TOKEN),
        source=StateDictSource(new),
    )

    async def driven() -> Any:
        async with GateWeightClient(url, TOKEN) as gate:
            version = (await gate.info()).version + 1
            async with gate.external_update(version):
                await anyio.to_thread.run_sync(engine.send_weights)
            return await gate.info()

    info = run(driven)
    assert (info.phase, info.engine_version) == ("READY", str(info.version))
    assert engine_parity(url, model, new) <= SAME
    assert captured(url) == (200, info.version)


# ---- the fleet --------------------------------------------------------------------------


@pytest.mark.usefixtures("restore")
def test_a_push_that_fails_on_one_gate_holds_the_fleet_until_a_push_succeeds_on_all(
    gates: list[str], gate_logs: Path, model: Any, original: Weights, tmp_path: Path
) -> None:
    new = perturbed(original, seed=4)

    async def broken_fleet() -> FleetPushError:
        good = GateWeightClient(gates[0], TOKEN)
        unreachable_shm = GateWeightClient(gates[1], TOKEN, shm_dir=str(tmp_path / "missing"))
        async with FleetWeightSync([good, unreachable_shm]) as fleet:
            version = max(i.version for i in await fleet.infos()) + 1
            with pytest.raises(FleetPushError) as failed:
                await fleet.push(new, version)
            assert await fleet.current_version() is None
            return failed.value

    error = run(broken_fleet)
    assert [o.error for o in error.outcomes] == [None, "stage_failed"]
    for url in gates:  # gate 0 loaded the new weights, and still refuses captured calls
        assert captured(url) == (503, "weights_unavailable")
    assert engine_parity(gates[0], model, new) <= SAME

    async def fleet_push() -> tuple[int, int | None]:
        async with FleetWeightSync([(url, TOKEN) for url in gates]) as fleet:
            version = max(i.version for i in await fleet.infos()) + 1
            infos = await fleet.push(new, version)
            assert {(i.phase, i.version, i.held) for i in infos} == {("READY", version, None)}
            return version, await fleet.current_version()

    version, current = run(fleet_push)
    assert current == version
    assert loaded_directly(last_load(gate_logs, 0))
    assert "layerwise reload (TOKCAP_SHM_LOAD=layerwise)" in last_load(gate_logs, 1)
    for url in gates:  # the same weights, however each engine loaded them
        assert captured(url) == (200, version)
        assert engine_parity(url, model, new) <= SAME


def test_a_single_gate_push_does_not_lift_the_fleets_hold(
    gates: list[str], original: Weights
) -> None:
    async def scenario() -> tuple[str, str | None, list[str]]:
        async with FleetWeightSync([(url, TOKEN) for url in gates]) as fleet:
            await fleet.hold("test")
            async with GateWeightClient(gates[0], TOKEN) as c:
                pushed = await c.push(original, (await c.info()).version + 1, release=False)
            version = max(i.version for i in await fleet.infos()) + 1
            infos = await fleet.push(original, version)
            return pushed.phase, pushed.held, [i.phase for i in infos]

    phase, held, after = run(scenario)
    assert (phase, held) == ("FAILED", "test")
    assert after == ["READY", "READY"]
