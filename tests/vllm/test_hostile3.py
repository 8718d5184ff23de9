"""Hostile clients and careless operators, part 3 (issue #33), on a real served gate: what
the engine's side owns (breaks 1, 2, 7, 8; Q2, Q3, Q6).

One ``tokcap-vllm serve --tokcap-sink tq`` process (the real CLI, vLLM's RL routes on,
``tokcap_shm`` pushes) attached to the session's Ray + TransferQueue; this test process is
the trainer and the harness. Each case abuses the gate, then checks the rule of the issue:
a typed refusal or a verified result, never a 200 whose receipt is poisoned, an unguarded
weight change or a dead gate; after each, a good push lands and a fresh rollout verifies.
The TransferQueue restart (break 1) runs last: it replaces the session's TransferQueue.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from tests.e2e._gates import ServedGate
from tests.vllm._helpers import wait_until
from tokcap.compose import served_gate_options
from tokcap_core.ledger import Staged
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import ControlPlaneClient
from tokcap_vllm.transfer._shm import SHM_DIR
from tokcap_vllm.weights import GateWeightClient, WeightPushError, WeightSyncError

# The whole module runs last (tests/conftest.py): its last test replaces the session's TQ.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.replaces_tq]

TOKEN = "hostile3-" + secrets.token_hex(12)
AUTH = {"authorization": f"Bearer {TOKEN}"}
SINK = TQSinkConfig(staging_partition="hostile3_staging", training_partition="hostile3_training")
_IDS = itertools.count()
Weights = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def gate(
    tiny_model: Path, tq_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The served gate's base URL (stopped after the module)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    options = [*served_gate_options(SINK, address), "--tokcap-attach-timeout-s", "120"]
    log = tmp_path_factory.mktemp("hostile3") / "gate.log"
    served = ServedGate(tiny_model, options, token=TOKEN, log=log)
    try:
        served.wait_healthy(TOKEN)
        yield served.url
    finally:
        served.stop()


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> Weights:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers=AUTH, timeout=120)


def _captured(url: str, rollout: str | None = None, *, opened: bool = False) -> tuple[int, Any]:
    """One captured completion on a fresh rollout (or on ``rollout``, already open when
    ``opened``): (200, the staged weight version, its receipt verified) or (status, code)
    of the open or the call, whichever was refused."""
    rollout = rollout or f"h3-{next(_IDS)}"
    with _http(url) as http:
        if not opened:
            answer = http.post(f"/tokcap/v1/rollouts/{rollout}/open")
            if answer.status_code != 200:
                return answer.status_code, answer.json()["error"]["code"]
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "def g(x):", "max_tokens": 4, "temperature": 0}
        answer = http.post(f"/tokcap/rollouts/{rollout}/v1/completions", json=body)
    if answer.status_code != 200:
        return answer.status_code, answer.json()["error"]["code"]

    async def verified() -> int:
        async with ControlPlaneClient(url, TOKEN) as control:
            head = await control.close(rollout, reward=1.0)
            receipt = await control.receipt(rollout, expected_head=head)
            manifest = await control.manifest(rollout)
        assert receipt.ok, receipt.failure_reason
        (staged,) = [e.event for e in manifest.entries if isinstance(e.event, Staged)]
        return staged.weight_version

    return 200, anyio.run(verified)


def _health(url: str) -> dict[str, Any]:
    with _http(url) as http:
        answer = http.get("/tokcap/v1/health")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _version(url: str) -> int:
    async def info() -> int:
        async with GateWeightClient(url, TOKEN) as client:
            return (await client.info()).version

    return int(anyio.run(info))


def _push(url: str, weights: Weights, version: int | None = None, **kwargs: Any) -> int:
    async def push() -> int:
        async with GateWeightClient(url, TOKEN, **kwargs) as client:
            target = (await client.info()).version + 1 if version is None else version
            info = await client.push(weights, target)
            assert info.phase == "READY", info
            return info.version

    return int(anyio.run(push))


def _recovers(url: str, original: Weights) -> None:
    """A good push lands, and a fresh rollout verifies at its version."""
    version = _push(url, original)
    assert _captured(url) == (200, version)
    assert _health(url)["status"] == "ok"


# ---- break 2, Q3: versions the ledger cannot store, labels that desync -----------------------


def test_b2_version_2_63_is_refused_by_the_client_and_the_raw_route(
    gate: str, original: Weights
) -> None:
    before = _version(gate)

    async def push() -> str:
        async with GateWeightClient(gate, TOKEN) as client:
            with pytest.raises(WeightPushError) as refused:
                await client.push(original, 2**63)
            return refused.value.code

    assert anyio.run(push) == "bad_version"
    with _http(gate) as http:
        raw = http.post("/update_weight_version", json={"new_version": str(2**63)})
        assert (raw.status_code, raw.json()["error"]["code"]) == (422, "bad_version")
        assert http.get("/weight_info").json()["weight_version"] != str(2**63)
    assert _captured(gate) == (200, before)  # not poisoned: ledger_refused:bad_event_field
    _recovers(gate, original)  # and later pushes still go up


@pytest.mark.parametrize("label", ["abc", "-5", "1e3", "0x10", " 7", "\u00b2", "0"])
def test_q3_a_raw_version_label_is_a_typed_refusal_and_gate_and_ledger_agree(
    gate: str, label: str
) -> None:
    before = _version(gate)
    with _http(gate) as http:
        raw = http.post("/update_weight_version", json={"new_version": label})
    code = "version_not_increasing" if label == "0" and before > 0 else "bad_version"
    assert (raw.status_code, raw.json()["error"]["code"]) == (422, code)
    assert _version(gate) == before
    assert _captured(gate) == (200, before)


# ---- break 7, Q6: what a push may name and carry ----------------------------------------------


def _raw_update(url: str, path: str, entries: Any) -> httpx.Response:
    with _http(url) as http:
        return http.post(
            "/update_weights", json={"update_info": {"path": path, "entries": entries}}
        )


def _entries(url: str, original: Weights) -> Any:
    async def stage() -> Any:
        async with GateWeightClient(url, TOKEN) as client:
            return (await client.stage(await client.check(original))).entries

    return anyio.run(stage)


def test_b7_a_link_or_a_fifo_named_like_a_push_file_is_refused(
    gate: str, original: Weights, tmp_path: Path
) -> None:
    entries = _entries(gate, original)
    link = Path(SHM_DIR) / f"tokcap-push-h3link-{os.getpid()}"
    fifo = Path(SHM_DIR) / f"tokcap-push-h3fifo-{os.getpid()}"
    link.symlink_to(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")
    os.mkfifo(fifo)
    with _http(gate) as http:
        assert http.post("/start_weight_update").status_code == 200
    try:
        linked = _raw_update(gate, str(link), entries)
        assert (linked.status_code, linked.json()["error"]["code"]) == (422, "push_file_link")
        piped = _raw_update(gate, str(fifo), entries)  # answered at once: nothing blocks
        assert (piped.status_code, piped.json()["error"]["code"]) == (422, "push_file_not_regular")
    finally:
        link.unlink()
        fifo.unlink()
    assert _captured(gate) == (503, "weights_unavailable")  # the push failed: typed 503s
    assert _health(gate)["status"] == "degraded"
    _recovers(gate, original)


def test_q6_a_nan_push_through_the_raw_routes_never_goes_ready(
    gate: str, original: Weights
) -> None:
    nan = dict(original)
    nan["model.norm.weight"] = nan["model.norm.weight"] * float("nan")
    with pytest.raises(WeightSyncError) as failed:
        _push(gate, nan, check_finite=False)  # the client's check off: the engine refuses
    assert failed.value.code == "update_failed"
    assert "non_finite_weights" in failed.value.message
    assert _captured(gate) == (503, "weights_unavailable")
    _recovers(gate, original)


def test_q6_collective_rpc_is_refused_with_the_token(gate: str) -> None:
    with _http(gate) as http:
        for method in ("__init__", "sleep"):
            answer = http.post("/collective_rpc", json={"method": method})
            assert (answer.status_code, answer.json()["error"]["code"]) == (403, "route_refused")
    assert _captured(gate)[0] == 200


# ---- break 8: a push file shrunk between update and finish ----------------------------------


def test_b8_a_push_file_shrunk_before_the_finish_fails_the_push_not_the_gate(
    gate: str, original: Weights
) -> None:
    version = _version(gate) + 1

    async def shrunk() -> tuple[int, int, str]:
        async with (
            GateWeightClient(gate, TOKEN) as client,  # its push file lives as long as it does
            httpx.AsyncClient(base_url=gate, headers=AUTH, timeout=120) as http,
        ):
            staged = await client.stage(await client.check(original))
            await http.post("/pause", params={"mode": "wait"})
            await http.post("/start_weight_update")
            info = {"update_info": {"path": staged.path, "entries": staged.entries}}
            updated = await http.post("/update_weights", json=info)
            os.truncate(staged.path, 0)
            finished = await http.post(
                "/finish_weight_update", json={"weight_version": str(version)}
            )
            await http.post("/resume")
        return updated.status_code, finished.status_code, finished.text

    updated, finished, text = anyio.run(shrunk)
    assert (updated, finished) == (200, 500)
    assert "push_file_changed" in text
    assert _health(gate)["serving"] is True  # the engine lives
    assert _captured(gate) == (503, "weights_unavailable")
    _recovers(gate, original)


# ---- Q2, break 1: a health that tells the truth; a gate that outlives its TransferQueue ------


def test_q2_health_says_when_the_engine_is_paused(gate: str) -> None:
    assert (_health(gate)["engine"], _health(gate)["status"]) == ("running", "ok")
    with _http(gate) as http:
        assert http.post("/pause", params={"mode": "wait"}).status_code == 200
        try:
            paused = _health(gate)
        finally:
            assert http.post("/resume").status_code == 200
    assert (paused["engine"], paused["status"]) == ("paused", "degraded")
    assert _health(gate)["status"] == "ok"


def test_b1_a_gate_outlives_its_transferqueue_and_attaches_to_the_next(gate: str) -> None:
    """The trainer that started TransferQueue closes it on exit; the next trainer starts a
    new one. Meanwhile the gate says so and refuses captured calls (never a 200 poisoned
    ``stage_failed:timeout``); then it attaches to the new one by itself."""
    import transfer_queue as tq

    from tokcap_tq._local import init_tq, loopback_env

    assert _health(gate)["sink_error"] is None
    with _http(gate) as http:  # a rollout the harness opened before the sink went
        assert http.post("/tokcap/v1/rollouts/h3-open-before/open").status_code == 200
    tq.close()  # this process started the session's TransferQueue: the first trainer exits
    try:
        wait_until(lambda: _health(gate)["sink_error"] is not None, "health names the dead sink")
        assert _health(gate)["status"] == "degraded"
        # a new rollout is refused at its open (the gate cannot ask the sink for stale rows),
        # an open one at its call, before admission: both retryable, neither a poisoned 200
        assert _captured(gate) == (503, "sink_unavailable")
        assert _captured(gate, "h3-open-before", opened=True) == (503, "sink_unavailable")
    finally:
        with loopback_env():  # the next trainer's TransferQueue
            init_tq({"num_data_storage_units": 1}, 300)
    wait_until(
        lambda: _health(gate)["status"] == "ok", "the gate attached to the new TransferQueue"
    )
    assert _captured(gate, "h3-after-restart")[0] == 200

    async def staged_rows() -> list[str]:
        return [str(key) for key in await TQSink(SINK).staged_keys()]

    assert "h3-after-restart/c000001" in anyio.run(staged_rows)  # in the new one
