"""Device check (CUDA vLLM only): routed experts captured through the gate on a tiny MoE.

NOT RUN in the session that wrote it (no GPU was lent). It needs a CUDA build of vLLM with
Model Runner V2 (``enable_return_routed_experts``). It builds the tiny Qwen3-MoE (4 experts,
top-2, 2 layers), serves it through the gate with ``--enable-return-routed-experts``, runs a
4-turn captured conversation and checks, for the reassembled row: routes cover every token
``[len(input_ids), layers=2, topk=2]``; every row but the terminal's last is known (0..3,
parents' last tokens backfilled from their child's prefill); the dtype is int8; and each
call's staged routes equal ``[tokens - 1]`` engine rows + one pad. Exit 0 on success.

    python bench/device_check_routes.py        # ~2-4 min on one GPU, mostly start-up
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import anyio
    import openai

    from tokcap.tiny import build_tiny_model
    from tokcap_core import assemble_receipt, reassemble, verify_manifest
    from tokcap_core.ledger import manifest_of
    from tokcap_vllm import InProcessServer

    model = str(build_tiny_model(Path("/tmp/tokcap-tiny/moe"), kind="moe"))
    server = InProcessServer(
        model,
        vllm_args=[
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--enable-return-routed-experts",
            "--gpu-memory-utilization",
            "0.3",
        ],
    ).start()
    try:

        async def conversation() -> None:
            async with openai.AsyncOpenAI(
                base_url=server.rollout_url("moe-device"), api_key="x"
            ) as c:
                messages = [{"role": "user", "content": "route me"}]
                for turn in range(4):
                    r = await c.chat.completions.create(
                        model=model, messages=messages, max_tokens=8, temperature=0
                    )
                    messages += [
                        {"role": "assistant", "content": r.choices[0].message.content or ""},
                        {"role": "tool", "content": f"obs {turn}"},
                    ]

        anyio.run(conversation)

        async def collect():  # type: ignore[no-untyped-def]
            await server.gate.close("moe-device", reward=1.0)
            receipt = assemble_receipt(
                verify_manifest(manifest_of(server.gate.ledger("moe-device")))
            )
            staged = await server.gate.sink.get([c.staging_key for c in receipt.segments[0]])
            return receipt, staged

        receipt, staged = server.call(collect)
        assert receipt.ok, receipt.failure_reason
        assert len(receipt.segments[0]) == 4, "the conversation did not chain"
        for call in staged:
            assert call.routes is not None, f"{call.call_id}: no routes captured"
            assert call.routes.dtype == "int8", call.routes.dtype
            assert call.routes.shape[1:] == (2, 2), call.routes.shape
        (row,) = reassemble(receipt, staged, max_seq_len=4096)
        assert row.routes is not None
        assert row.routes.shape == (len(row.input_ids), 2, 2)
        width = 4
        data = list(row.routes.data)
        known = data[:-width]
        assert all(0 <= e < 4 for e in known), "unknown route rows inside the row"
        assert data[-width:] == [-1] * width
        assert row.backfilled_route_rows == 3
        print(
            f"OK: {len(row.input_ids)} tokens, routes {row.routes.shape}, "
            f"backfilled {row.backfilled_route_rows}"
        )
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
