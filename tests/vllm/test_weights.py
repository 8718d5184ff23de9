"""Weight pushes into the session's running vLLM CPU engine, checked against the trainer.

Rows are captured through the gate with the real OpenAI client; the trainer side is
`tokcap.train` on the same tiny fp32 model; parity is `tokcap_core.logprob_parity`. Every
test that pushes restores the engine's original weights afterwards (the engine is shared).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.vllm._helpers import client, close_and_reassemble
from tests.vllm._vlm import moved
from tokcap.train import Trainer, collate, token_logprobs
from tokcap_core import LogprobParity, TrainingRow, logprob_parity
from tokcap_vllm import InProcessServer, WeightPushError, WeightSync
from tokcap_vllm.transfer._weights import _chunks
from tokcap_vllm.weights import WeightPhase, WeightState

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Weights = dict[str, torch.Tensor]
SAME = 1e-9  # K3 of fp32 engine vs fp32 trainer on the same weights (measured ~1e-14)
APART = 1e-4  # K3 between the weights before and after a push (measured >1e-3)
_ROLLOUTS = itertools.count()
LONG_PROMPT = " ".join(f"line {i}: def f{i}(x): return x * {i}" for i in range(30))


def engine_client(server: InProcessServer) -> Any:
    """vLLM's engine client (AsyncLLM) behind the session server (uvicorn's app state)."""
    return server._server.config.app.state.engine_client


def on_loop(
    server: InProcessServer, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
) -> Any:
    """``await fn(*args, **kwargs)`` on the server's event loop, where the engine client lives."""
    return server.call(functools.partial(fn, **kwargs), *args)


@pytest.fixture(scope="module")
def sync(server: InProcessServer) -> WeightSync:
    return on_loop(server, WeightSync.connect, engine_client(server))


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def original(model: Any) -> Weights:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture
def restore(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> Iterator[None]:
    """After the test, whatever it did: the original weights pushed in full, generation resumed."""
    yield
    on_loop(server, sync.push, original, sync.state.version + 1)
    model.load_state_dict(original)
    assert sync.state.serving


def perturbed(
    model: Any, original: Weights, *, seed: int, scale: float = 0.05, only: str = ""
) -> Weights:
    """The original weights plus seeded noise on parameters named ``only*`` (tied heads follow)."""
    model.load_state_dict(original)
    return moved(model, seed, scale, only)


def capture(
    server: InProcessServer, *, prompt: str = "", count: int = 3, max_tokens: int = 12
) -> tuple[list[TrainingRow], list[Any]]:
    """``count`` rollouts through the gate (sampled at T=1), closed and reassembled: their rows,
    and their staged calls and receipt calls (each carries a weight version)."""
    ids = [f"weights-{next(_ROLLOUTS)}" for _ in range(count)]

    async def run() -> None:
        for i, rollout_id in enumerate(ids):
            async with client(server, rollout_id) as c:
                await c.chat.completions.create(
                    model=server.model,
                    messages=[
                        {"role": "user", "content": prompt or f"task {rollout_id}: list files"}
                    ],
                    max_tokens=max_tokens,
                    temperature=1.0,
                    seed=i,
                )

    anyio.run(run)
    rows, records = [], []
    for rollout_id in ids:
        receipt, got, calls = close_and_reassemble(server, rollout_id)
        assert receipt.ok
        rows += got
        records += list(calls.values()) + [call for segment in receipt.segments for call in segment]
    return rows, records


def parity(model: Any, weights: Weights, rows: list[TrainingRow]) -> LogprobParity:
    """The engine's captured logprobs against the trainer's recompute with ``weights``."""
    model.load_state_dict(weights)
    with torch.no_grad():
        recomputed = token_logprobs(model, collate(rows))
    return logprob_parity(
        [row.logprobs for row in rows],
        [recomputed[i, : len(row.input_ids)].tolist() for i, row in enumerate(rows)],
        [row.loss_mask for row in rows],
        valid_N=[row.sample_mask for row in rows],
    )


def versions(rows: list[TrainingRow], records: list[Any]) -> set[int]:
    """Every weight version the staged calls, receipts and rows name."""
    return {c.weight_version for c in records} | {
        v for row in rows for v in (row.weight_version_min, row.weight_version_max)
    }


# ---- parity and pushes ---------------------------------------------------------------------


def test_engine_and_trainer_agree_on_the_same_weights(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    rows, staged = capture(server)
    same = parity(model, original, rows)
    assert same.tokens >= 3
    assert same.k3 <= SAME
    assert same.max_abs < 1e-5
    assert versions(rows, staged) == {sync.state.version}


@pytest.mark.usefixtures("restore")
def test_a_push_moves_the_engine_onto_the_trainers_new_logprobs(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    model.load_state_dict(original)
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=2e-2), version=sync.state.version
    )
    before_rows, _ = capture(server)
    first = trainer.step(before_rows, [1.0, -1.0, 0.5])
    assert first.parity.k3 <= SAME  # the trainer's own report: the engine held its weights
    assert first.staleness_max == 0

    state = on_loop(server, sync.push, trainer.weights(), trainer.version)
    assert state == WeightState(phase=WeightPhase.READY, version=trainer.version)

    new = {name: tensor.clone() for name, tensor in trainer.weights().items()}
    stale = parity(model, new, before_rows)  # rows of the old weights vs the new trainer
    after_rows, staged = capture(server)
    fresh = parity(model, new, after_rows)
    assert stale.k3 > APART
    assert fresh.k3 <= SAME
    assert stale.k3 > 1e4 * max(fresh.k3, 1e-15)
    assert versions(after_rows, staged) == {trainer.version}
    second = trainer.step(after_rows, [1.0, -1.0, 0.5])  # the loop goes on: parity holds
    assert second.parity.k3 <= SAME
    assert second.staleness_max == 0


@pytest.mark.usefixtures("restore")
def test_a_push_through_shared_memory_lands_the_same_and_leaves_no_file(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    new = perturbed(model, original, seed=11)
    before = set(Path(sync.shm_dir).glob("tokcap-push-*"))
    state = on_loop(server, sync.push, new, sync.state.version + 1, transport="shm")
    assert state.serving
    assert set(Path(sync.shm_dir).glob("tokcap-push-*")) == before
    rows, records = capture(server)
    assert parity(model, new, rows).k3 <= SAME
    assert versions(rows, records) == {state.version}


@pytest.mark.usefixtures("restore")
def test_tied_embeddings_move_the_head_too(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    new = perturbed(model, original, seed=1, only="model.embed_tokens")
    assert torch.equal(new["lm_head.weight"], new["model.embed_tokens.weight"])
    on_loop(server, sync.push, new, sync.state.version + 1)
    rows, _ = capture(server)
    assert parity(model, new, rows).k3 <= SAME
    assert parity(model, original, rows).k3 > APART


def test_a_push_without_the_tied_head_or_with_a_different_one_is_refused(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    new = perturbed(model, original, seed=2)
    headless = {name: t for name, t in new.items() if name != "lm_head.weight"}
    untied = dict(new, **{"lm_head.weight": new["lm_head.weight"] + 0.01})
    for weights, code in ((headless, "missing_tensors"), (untied, "tied_mismatch")):
        with pytest.raises(WeightPushError) as info:
            on_loop(server, sync.push, weights, sync.state.version + 1)
        assert info.value.code == code


@pytest.mark.usefixtures("restore")
def test_a_cached_prompt_scored_after_a_push_matches_the_trainer(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    assert engine_client(server).vllm_config.cache_config.enable_prefix_caching
    capture(server, prompt=LONG_PROMPT, count=1)  # the prompt's KV is now cached
    new = perturbed(model, original, seed=3, scale=0.1)
    on_loop(server, sync.push, new, sync.state.version + 1)
    rows, _ = capture(server, prompt=LONG_PROMPT, count=1, max_tokens=24)
    assert rows[0].prompt_len > 200
    assert parity(model, new, rows).k3 <= SAME


@pytest.mark.usefixtures("restore")
def test_without_the_prefix_cache_reset_a_cached_prompt_is_scored_by_stale_kv(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    """The control for the test above: the same swap minus the reset fails parity."""
    engine = engine_client(server)
    capture(server, prompt=LONG_PROMPT, count=1)
    new = perturbed(model, original, seed=3, scale=0.1)
    (chunk,) = list(_chunks(sorted(new.items()), 1 << 30))

    async def swap_without_reset() -> None:
        await engine.collective_rpc("tokcap_stage", args=("no-reset", chunk))
        await engine.pause_generation(mode="wait", clear_cache=False)
        await engine.collective_rpc("tokcap_commit", args=("no-reset", len(chunk)))
        await engine.resume_generation()

    on_loop(server, swap_without_reset)
    fresh, _ = capture(server, prompt="a prompt nobody sent before", count=1)
    assert parity(model, new, fresh).k3 <= SAME  # the weights did load...
    rows, _ = capture(server, prompt=LONG_PROMPT, count=1, max_tokens=24)
    assert parity(model, new, rows).k3 > APART  # ...but the cached prompt's KV is the old one


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (
            lambda w: w.pop("model.layers.0.self_attn.k_proj.weight"),
            "missing_tensors",
        ),  # q and v alone
        (lambda w: w.update(extra=torch.zeros(1)), "unknown_tensors"),
        (lambda w: w.update({"model.norm.weight": torch.ones(65)}), "shape_mismatch"),
        (lambda w: w.update({k: v.to(torch.bfloat16) for k, v in w.items()}), "dtype_mismatch"),
        (
            lambda w: w["model.layers.1.mlp.up_proj.weight"].view(-1).__setitem__(7, float("nan")),
            "non_finite_weights",
        ),
    ],
)
def test_a_bad_push_is_refused_and_the_engine_keeps_its_weights(
    server: InProcessServer,
    sync: WeightSync,
    model: Any,
    original: Weights,
    edit: Callable[[Weights], object],
    code: str,
) -> None:
    bad = perturbed(model, original, seed=4, scale=0.2)
    edit(bad)
    before = sync.state
    with pytest.raises(WeightPushError) as info:
        on_loop(server, sync.push, bad, before.version + 1)
    assert info.value.code == code
    assert sync.state == before
    rows, staged = capture(server, count=1)
    assert parity(model, original, rows).k3 <= SAME
    assert versions(rows, staged) == {before.version}


def test_the_worker_refuses_what_the_server_side_check_would_have(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights, tmp_path: Path
) -> None:
    """Defence in depth: the worker checks each staged tensor and the whole set before loading."""
    engine = engine_client(server)
    (full,) = list(_chunks(sorted(perturbed(model, original, seed=5).items()), 1 << 30))
    name, dtype, shape, data = full[0]

    async def attempt(*calls: tuple[str, tuple[Any, ...]]) -> str:
        try:
            for method, args in calls:
                await engine.collective_rpc(method, args=args)
        except Exception as e:
            return str(e)
        finally:
            await engine.collective_rpc("tokcap_discard", args=("w",))
        return ""

    assert "unknown tensor" in on_loop(
        server, attempt, ("tokcap_stage", ("w", [("x", dtype, shape, data)]))
    )
    assert "expected" in on_loop(
        server, attempt, ("tokcap_stage", ("w", [(name, "float64", shape, data)]))
    )
    assert "bytes" in on_loop(
        server, attempt, ("tokcap_stage", ("w", [(name, dtype, shape, bytes(data)[:-4])]))
    )
    assert "incomplete" in on_loop(
        server, attempt, ("tokcap_stage", ("w", full[:-1])), ("tokcap_commit", ("w", len(full) - 1))
    )
    assert "staged nothing" in on_loop(server, attempt, ("tokcap_commit", ("other", len(full))))
    short = tmp_path / "tokcap-push-short"
    short.write_bytes(bytes(data)[:-4])
    entry = (name, dtype, shape, 0, len(data))
    assert "entry_out_of_file" in on_loop(
        server, attempt, ("tokcap_stage_file", ("w", str(short), [entry]))
    )
    other = tmp_path / "weights.bin"  # only push files are ever read (tokcap_vllm.transfer._shm)
    other.write_bytes(bytes(data))
    assert "not a tokcap push file" in on_loop(
        server, attempt, ("tokcap_stage_file", ("w", str(other), [entry]))
    )
    rows, _ = capture(server, count=1)
    assert parity(model, original, rows).k3 <= SAME


# ---- failures midway, concurrency, in-flight requests --------------------------------------


@pytest.mark.usefixtures("restore")
def test_a_push_that_fails_midway_leaves_failed_and_paused_until_a_full_push(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    """A real mid-push fault: another client's stage call (a new push id) drops the staged
    tensors after the pause began, so the commit fails; nothing may be served until a full push."""
    engine = engine_client(server)
    new = perturbed(model, original, seed=6)
    seen: list[WeightState] = []

    intruders: list[asyncio.Future[Any]] = []

    def intrude(state: WeightState) -> None:
        seen.append(state)
        if state.phase is WeightPhase.PUSHING:
            stage = engine.collective_rpc("tokcap_stage", args=("intruder", []))
            intruders.append(asyncio.ensure_future(stage))

    async def failing_push() -> tuple[str, bool]:
        unsubscribe = sync.subscribe(intrude)
        try:
            await sync.push(new, sync.state.version + 1)
        except Exception as e:
            return getattr(e, "code", repr(e)), await engine.is_paused()
        finally:
            unsubscribe()
        return "pushed", await engine.is_paused()

    last = sync.state.version
    assert on_loop(server, failing_push) == ("commit_failed", True)
    assert [s.phase for s in seen] == [WeightPhase.PUSHING, WeightPhase.FAILED]
    assert sync.state == WeightState(
        phase=WeightPhase.FAILED, version=last, target=last + 1, error="commit_failed"
    )
    assert not sync.state.serving

    state = on_loop(server, sync.push, new, last + 1)
    assert state.serving
    assert on_loop(server, engine.is_paused) is False
    rows, _ = capture(server, count=1)
    assert parity(model, new, rows).k3 <= SAME


@pytest.mark.usefixtures("restore")
def test_a_cancelled_push_is_failed_never_silently_ready(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    new = perturbed(model, original, seed=7)

    async def cancelled_push() -> WeightState:
        with anyio.CancelScope() as scope:
            unsubscribe = sync.subscribe(
                lambda s: scope.cancel() if s.phase is WeightPhase.PUSHING else None
            )
            try:
                await sync.push(new, sync.state.version + 1)
            finally:
                unsubscribe()
        assert scope.cancelled_caught
        return sync.state

    assert on_loop(server, cancelled_push).phase is WeightPhase.FAILED


@pytest.mark.usefixtures("restore")
def test_a_second_concurrent_push_is_refused(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    new = perturbed(model, original, seed=8)

    async def two_pushes() -> tuple[str, WeightState]:
        first = asyncio.ensure_future(sync.push(new, sync.state.version + 1))
        await asyncio.sleep(0)  # the first push is now staging
        try:
            await sync.push(new, sync.state.version + 2)
        except WeightPushError as e:
            return e.code, await first
        return "accepted", await first

    code, state = on_loop(server, two_pushes)
    assert code == "push_in_progress"
    assert state.serving


async def _generate_across_a_push(
    engine: Any, sync: WeightSync, weights: Weights, mode: str, prompt: list[int]
) -> tuple[list[int], list[float], Any, WeightState, bool]:
    """Generate 48 tokens; after the 8th, push ``weights`` with ``mode``. Returns ids, logprobs,
    vLLM's weight-version spans, the push's state and whether the generation ended first."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    params = SamplingParams(max_tokens=48, temperature=1.0, logprobs=0, ignore_eos=True, seed=3)
    started = asyncio.Event()
    final: list[Any] = []

    async def generate() -> None:
        async for out in engine.generate(
            tokens_input(prompt), params, f"across-{mode}-{sync.state.version}"
        ):
            if len(out.outputs[0].token_ids) >= 8:
                started.set()
            final.append(out)

    task = asyncio.ensure_future(generate())
    await started.wait()
    state = await sync.push(weights, sync.state.version + 1, mode=mode)  # type: ignore[arg-type]
    ended_first = task.done()
    await task
    c = final[-1].outputs[0]
    logprobs = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
    return list(c.token_ids), logprobs, c.weight_versions, state, ended_first


def _recompute(model: Any, weights: Weights, prompt: list[int], ids: list[int]) -> list[float]:
    model.load_state_dict(weights)
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
    return logprobs.gather(-1, x[0, 1:, None])[len(prompt) - 1 :, 0].tolist()


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_in_flight_requests_resume_on_the_new_weights_in_two_spans(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights, mode: str
) -> None:
    """``recompute``: the frozen request's KV is recomputed by the new weights, so each span
    is exactly what its own weights give on the whole sequence. ``keep``: it resumes on the
    KV the old weights computed, so tokens after the push are neither (stale KV)."""
    engine = engine_client(server)
    new = perturbed(model, original, seed=9, scale=0.1)
    prompt = list(range(100, 140))
    old_version = sync.state.version
    ids, engine_lp, spans, state, _ = on_loop(
        server, _generate_across_a_push, engine, sync, new, mode, prompt
    )
    (first, second) = spans
    assert (first.version, first.start, second.version, second.end) == (
        str(old_version),
        0,
        str(state.version),
        48,
    )
    assert first.end == second.start >= 8
    cut = first.end
    old_lp, new_lp = _recompute(model, original, prompt, ids), _recompute(model, new, prompt, ids)
    assert max(abs(a - b) for a, b in zip(engine_lp[:cut], old_lp[:cut], strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(engine_lp[cut:], old_lp[cut:], strict=True)) > 1e-3
    after_push = max(abs(a - b) for a, b in zip(engine_lp[cut:], new_lp[cut:], strict=True))
    if mode == "recompute":
        assert after_push < 1e-5  # each span was sampled by its own weights on fresh KV
    else:
        assert after_push > 1e-4  # new weights on the old weights' KV


@pytest.mark.usefixtures("restore")
def test_wait_mode_lets_in_flight_requests_finish_on_the_old_weights(
    server: InProcessServer, sync: WeightSync, model: Any, original: Weights
) -> None:
    engine = engine_client(server)
    new = perturbed(model, original, seed=10, scale=0.1)
    prompt = list(range(200, 240))
    old_version = sync.state.version
    ids, engine_lp, spans, state, ended_first = on_loop(
        server, _generate_across_a_push, engine, sync, new, "wait", prompt
    )
    assert ended_first  # the push waited for the request
    assert [(s.version, s.start, s.end) for s in spans] == [(str(old_version), 0, 48)]
    old_lp = _recompute(model, original, prompt, ids)
    assert max(abs(a - b) for a, b in zip(engine_lp, old_lp, strict=True)) < 1e-5
    assert state.version == old_version + 1
