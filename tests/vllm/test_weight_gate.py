"""The gate and weight pushes on the session's running vLLM CPU engine.

A gate that watches a `WeightSync` refuses captured calls while a push that failed after
the pause leaves the weights FAILED, and admits them while a push is under way (the
engine queues them and generates them on the new weights). A captured call generated
across a push records the versions of its first and last tokens in its staged call, the
ledger, the receipt and the row. Every test that pushes restores the original weights.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.vllm._helpers import client, close_and_reassemble
from tokcap_core.ledger import Admitted, Staged
from tokcap_core.provenance import VersionSpan, row_staleness
from tokcap_vllm import InProcessServer, WeightSync
from tokcap_vllm.gate._host import _weight_spans
from tokcap_vllm.weights import WeightPhase, WeightState

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Weights = dict[str, torch.Tensor]
_ROLLOUTS = itertools.count()


def on_loop(
    server: InProcessServer, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
) -> Any:
    """``await fn(*args, **kwargs)`` on the server's event loop, where the engine client lives
    (a generous hang guard: the shared CPU box can be very loaded)."""
    return server.call(functools.partial(fn, **kwargs), *args, timeout=600)


def rollout(name: str) -> str:
    return f"wgate-{name}-{next(_ROLLOUTS)}"


@pytest.fixture(scope="module")
def sync(server: InProcessServer) -> Iterator[WeightSync]:
    """A `WeightSync` the session gate watches for this module."""

    async def connect() -> tuple[WeightSync, Callable[[], None]]:
        weights = await WeightSync.connect(server.engine_client)
        return weights, server.gate.watch_weights(weights)

    weights, unwatch = on_loop(server, connect)
    yield weights
    server.call(_unwatch, unwatch)


async def _unwatch(unwatch: Callable[[], None]) -> None:
    unwatch()


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> Weights:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def nudged(original: Weights, *, seed: int, scale: float = 0.05) -> Weights:
    """The original weights plus seeded noise (the tied head shares the embedding's)."""
    generator = torch.Generator().manual_seed(seed)
    out = {name: tensor.clone() for name, tensor in original.items()}
    for name, tensor in out.items():
        if name != "lm_head.weight" and tensor.is_floating_point():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.fixture
def restore(server: InProcessServer, sync: WeightSync, original: Weights) -> Iterator[None]:
    """After the test, whatever it did: the original weights pushed in full, generation resumed."""
    yield
    on_loop(server, sync.push, original, sync.state.version + 1)
    assert sync.state.serving


def staged_versions(server: InProcessServer, rollout_id: str) -> list[tuple[int, int]]:
    """``(weight_version, weight_version_last)`` of each ``Staged`` entry of the rollout."""
    server.call(server.gate.drain)
    return [
        (e.event.weight_version, e.event.weight_version_last)
        for e in server.gate.ledger(rollout_id).entries
        if isinstance(e.event, Staged)
    ]


def admitted(server: InProcessServer, rollout_id: str) -> int:
    """How many calls of the rollout the gate admitted (0 if it holds no such rollout)."""
    if rollout_id not in server.gate.rollouts():
        return 0
    entries = server.gate.ledger(rollout_id).entries
    return sum(isinstance(e.event, Admitted) for e in entries)


async def chat(server: InProcessServer, rollout_id: str, **kwargs: Any) -> Any:
    async with client(server, rollout_id) as c:
        return await c.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": f"{rollout_id}: count to ten"}],
            temperature=1.0,
            seed=1,
            **{"max_tokens": 8, **kwargs},
        )


# ---- vLLM's weight-version spans, as the capture host reads them ------------------------------


def test_the_host_keeps_every_span_and_maps_each_label_on_its_own() -> None:
    from vllm.outputs import WeightVersionSpan as Span

    def spans(*triples: tuple[int, int, int]) -> tuple[VersionSpan, ...]:
        return tuple(VersionSpan(version=v, start=a, end=b) for v, a, b in triples)

    assert _weight_spans([], 7, 5) == spans((7, 0, 5))
    assert _weight_spans([Span("default", 0, 5)], 7, 5) == spans((7, 0, 5))
    # vLLM's initial "default" label no longer hides a later integer version
    assert _weight_spans([Span("default", 0, 5), Span("9", 5, 9)], 7, 9) == spans(
        (7, 0, 5), (9, 5, 9)
    )
    # a label that reads as the version before it merges into its span
    assert _weight_spans([Span("2", 0, 1), Span("x", 1, 2), Span("4", 2, 3)], 2, 3) == spans(
        (2, 0, 2), (4, 2, 3)
    )
    # the spans tile exactly the tokens returned (a stop string trimmed the last two)
    assert _weight_spans([Span("5", 0, 4), Span("6", 4, 8)], 1, 6) == spans((5, 0, 4), (6, 4, 6))


# ---- a failed push ----------------------------------------------------------------------------


@pytest.mark.usefixtures("restore")
def test_after_a_failed_push_captured_calls_are_refused_until_a_full_push(
    server: InProcessServer, sync: WeightSync, original: Weights
) -> None:
    """A real mid-push fault (another client's stage call drops the staged tensors after the
    pause began, so the commit fails) leaves FAILED; the gate answers 503 and admits nothing."""
    engine = server.engine_client
    new = nudged(original, seed=11)
    intruders: list[asyncio.Future[Any]] = []

    def intrude(state: WeightState) -> None:
        if state.phase is WeightPhase.PUSHING:
            stage = engine.collective_rpc("tokcap_stage", args=("intruder", []))
            intruders.append(asyncio.ensure_future(stage))

    async def failing_push() -> str:
        unsubscribe = sync.subscribe(intrude)
        try:
            await sync.push(new, sync.state.version + 1)
        except Exception as e:
            return str(getattr(e, "code", repr(e)))
        finally:
            unsubscribe()
        return "pushed"

    assert on_loop(server, failing_push) == "commit_failed"
    assert sync.state.phase is WeightPhase.FAILED

    refused = rollout("failed")
    with pytest.raises(openai.APIStatusError) as caught:
        on_loop(server, chat, server, refused)
    assert caught.value.status_code == 503
    assert caught.value.code == "weights_unavailable"
    assert "full push" in caught.value.message
    assert admitted(server, refused) == 0  # refused before admission: no ledger entry

    state = on_loop(server, sync.push, new, sync.state.version + 1)
    assert state.serving
    accepted = rollout("after")
    on_loop(server, chat, server, accepted)
    assert staged_versions(server, accepted) == [(state.version, state.version)]
    receipt, rows, _ = close_and_reassemble(server, accepted)
    assert receipt.ok
    assert [(r.weight_version_min, r.weight_version_max) for r in rows] == [
        (state.version, state.version)
    ]


# ---- calls during a push ----------------------------------------------------------------------


@pytest.mark.usefixtures("restore")
def test_a_call_that_arrives_during_a_push_is_admitted_and_runs_on_the_new_weights(
    server: InProcessServer, sync: WeightSync, original: Weights
) -> None:
    """A long uncaptured request keeps the push (mode ``wait``) PUSHING while a captured call
    arrives: the gate admits it, the engine holds it, and it is generated by the new weights."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    engine = server.engine_client
    new = nudged(original, seed=12)
    during = rollout("during")
    seen: list[tuple[WeightPhase, int]] = []

    def watch(state: WeightState) -> None:
        seen.append((state.phase, admitted(server, during)))

    async def scenario() -> tuple[WeightState, Any]:
        params = SamplingParams(max_tokens=800, temperature=1.0, ignore_eos=True, seed=5)
        started = asyncio.Event()

        async def long_request() -> None:
            async for out in engine.generate(
                tokens_input(list(range(50, 90))), params, f"long-{during}"
            ):
                if len(out.outputs[0].token_ids) >= 4:
                    started.set()

        long = asyncio.ensure_future(long_request())
        await started.wait()
        unsubscribe = sync.subscribe(watch)
        try:
            push = asyncio.ensure_future(sync.push(new, sync.state.version + 1))
            while sync.state.phase is not WeightPhase.PUSHING:
                await asyncio.sleep(0.005)
            response = await chat(server, during)
            state = await push
        finally:
            unsubscribe()
        await long
        return state, response

    state, response = on_loop(server, scenario)
    assert response.choices[0].message.content is not None
    # the call was admitted while the push was still under way (before READY)
    assert seen[-1][0] is WeightPhase.READY
    assert seen[-1][1] == 1
    assert staged_versions(server, during) == [(state.version, state.version)]


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_call_generated_across_a_push_records_both_versions_down_to_the_row(
    server: InProcessServer, sync: WeightSync, original: Weights, mode: str
) -> None:
    """A streamed captured call; after its 8th chunk a push in ``mode`` freezes it and
    resumes it on the new weights: staged call, ledger, receipt and row name both versions,
    span by span. ``recompute``: the KV of the resumed call was recomputed by the new
    weights (its KV spans are its weight spans); ``keep``: it kept the old KV, so every
    token after the push is a stale-KV token."""
    new = nudged(original, seed=13)
    spanning = rollout(f"span-{mode}")
    old = sync.state.version

    async def scenario() -> WeightState:
        async with client(server, spanning) as c:
            stream = await c.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "write a long story"}],
                max_tokens=400,
                temperature=1.0,
                seed=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = 0
            push: asyncio.Future[WeightState] | None = None
            async for _ in stream:
                chunks += 1
                if chunks == 8:
                    push = asyncio.ensure_future(sync.push(new, old + 1, mode=mode))  # type: ignore[arg-type]
            assert push is not None
            return await push

    state = on_loop(server, scenario)
    assert state.version == old + 1
    assert state.kv_kept is (mode == "keep")
    assert staged_versions(server, spanning) == [(old, old + 1)]
    receipt, rows, calls = close_and_reassemble(server, spanning)
    assert receipt.ok
    ((link,),) = receipt.segments
    assert (link.weight_version, link.weight_version_last) == (old, old + 1)
    ((staged),) = calls.values()
    assert (staged.weight_version, staged.weight_version_last) == (old, old + 1)
    assert [(r.weight_version_min, r.weight_version_max) for r in rows] == [(old, old + 1)]
    first, second = staged.weight_versions or ()
    assert (first.version, first.start, second.version, second.end) == (old, 0, old + 1, 400)
    assert first.end == second.start >= 7
    if mode == "recompute":
        assert staged.kv_versions == staged.weight_versions
    else:
        assert staged.kv_versions == (VersionSpan(version=old, start=0, end=400),)
    # the ledger, the receipt and the row carry the same spans as the staged row
    assert (link.weight_versions, link.kv_versions) == (
        staged.weight_versions,
        staged.kv_versions,
    )
    ((span,),) = [row.call_spans for row in rows]
    assert (span.weight_versions, span.kv_versions) == (link.weight_versions, link.kv_versions)
    staleness = row_staleness(rows[0], old + 1)
    assert staleness.calls_spanning_versions == 1
    assert staleness.stale_kv_tokens == (0 if mode == "recompute" else second.length)
