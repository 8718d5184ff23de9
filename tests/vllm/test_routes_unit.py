"""Routed experts through the capture path, on fake engine outputs (CPU vLLM cannot return routes).

A fake engine yields vLLM ``RequestOutput``-shaped objects whose final output carries
``routed_experts`` shaped ``[tokens - 1, layers, topk]`` (what a CUDA engine returns). The
real `CaptureHost` and `Gate` stage them; reassembly must align every call's routes with its
tokens and backfill each parent's last (never-routed) token from the child's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np

from tokcap_core import CaptureConfig, assemble_receipt, reassemble, verify_manifest
from tokcap_core.ledger import manifest_of
from tokcap_vllm import Gate, GateConfig
from tokcap_vllm.extend import CaptureHost
from tokcap_vllm.gate._capture import Serve
from tokcap_vllm.gate._host import CURRENT_TICKET
from tokcap_vllm.gate._planning import ChatPlan, Observed, PlannedRequest

LAYERS, TOPK, EXPERTS = 2, 2, 4


def _route(position: int) -> list[list[int]]:
    return [
        [(position + layer) % EXPERTS, (position + layer + 1) % EXPERTS] for layer in range(LAYERS)
    ]


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    text: str = ""
    finish_reason: str | None = None
    weight_versions: Any = None
    routed_experts: Any = None


class FakeEngine:
    """Generates ``gen`` tokens per call and routes every position but the last (like vLLM CUDA)."""

    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_experts=EXPERTS))
    tokenizer = None

    def __init__(self, gen: int) -> None:
        self.gen = gen

    def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> Any:
        async def run() -> Any:
            ids = list(prompt["prompt_token_ids"])
            out = [100 + len(ids) + i for i in range(self.gen)]
            total = len(ids) + len(out)
            routes = np.array([_route(p) for p in range(total - 1)], dtype=np.int64)
            lps = [{t: SimpleNamespace(logprob=-0.5 - i / 10)} for i, t in enumerate(out)]
            yield SimpleNamespace(
                prompt_token_ids=ids,
                finished=True,
                outputs=[_Completion(out, lps, finish_reason="length", routed_experts=routes)],
            )

        return run()


def test_routes_are_aligned_and_backfilled_across_a_chain() -> None:
    """Three chained calls: the row's routes cover every token; parents' last rows come from
    the child's prefill."""
    gate = Gate(GateConfig(capture=CaptureConfig(capture_routes=True)))
    host = CaptureHost(FakeEngine(gen=3))
    host.install()
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    async def main() -> list[Any]:
        async with anyio.create_task_group() as tg:
            await tg.start(gate.serve)
            cum: list[int] = []
            for turn in range(3):
                suffix = [10 + turn, 11 + turn]
                plan = ChatPlan(
                    parent_id=f"c{turn:06d}" if turn else None,
                    prefix_len=len(cum),
                    prompt_ids=cum + suffix,
                    prompt_text="",
                    request_fingerprint=f"fp{turn}",
                    formation="extend" if turn else "root",
                )
                request = PlannedRequest(None, lambda *_, plan=plan: plan, lambda ids: "")
                served = await gate.capture.enter(
                    "moe-1", kind="completion", request=lambda request=request: request
                )
                assert isinstance(served, Serve)
                call, ticket = served.call, served.ticket
                assert ticket.prompt_ids == plan.prompt_ids
                token = CURRENT_TICKET.set(ticket)
                try:
                    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
                    async for _ in host.engine.generate(
                        {"prompt_token_ids": [0]}, params, f"r{turn}"
                    ):
                        pass
                finally:
                    CURRENT_TICKET.reset(token)
                assert ticket.result is not None
                cum = ticket.result.prompt_ids + list(ticket.result.output_ids)
                gate.capture.respond(call, Observed(f"resp-{turn}", None, None))
                await call.settled.wait()
            await gate.close("moe-1", reward=1.0)
            receipt = assemble_receipt(verify_manifest(manifest_of(gate.ledger("moe-1"))))
            staged = await gate.sink.get([c.staging_key for c in receipt.segments[0]])
            tg.cancel_scope.cancel()
            return [receipt, staged, cum]

    receipt, staged, cum = anyio.run(main)
    assert receipt.ok
    assert [c.parent_id for c in receipt.segments[0]] == [None, "c000001", "c000002"]
    assert all(s.routes is not None and s.routes.dtype == "int8" for s in staged)
    (row,) = reassemble(receipt, staged, max_seq_len=4096)
    assert list(row.input_ids) == cum
    assert row.routes is not None
    assert row.routes.shape == (len(cum), LAYERS, TOPK)
    flat = list(row.routes.data)
    width = LAYERS * TOPK
    for position in range(
        len(cum) - 1
    ):  # every position the engine routed, parents' last tokens included
        assert flat[position * width : (position + 1) * width] == [
            e for layer in _route(position) for e in layer
        ]
    assert flat[-width:] == [-1] * width  # the terminal's last token is never routed
    assert row.backfilled_route_rows == 2
