"""Shared helpers for the vLLM gate tests: run coroutines, read a closed rollout back."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tokcap_core import (
    CaptureConfig,
    StagedCall,
    TokenSink,
    TrainingRow,
    assemble_receipt,
    reassemble,
    verify_manifest,
)
from tokcap_core.ledger import manifest_of
from tokcap_vllm import ControlPlaneClient, Gate, GateConfig, InProcessServer

CONTROL_TOKEN = "tokcap-test-token-" + secrets.token_hex(12)
"""The session gate's control-plane token (tests assert it never shows up in any output)."""

VLLM_ARGS = [
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
    "--max-model-len",
    "4096",
    "--dtype",
    "float32",
    "--disable-log-stats",
    "--trust-request-chat-template",
    "--max-num-seqs",
    "128",
    # vLLM 0.32 CPU: a seeded request whose prefill is chunked kills the engine core
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens",
    "8192",
    "--worker-extension-cls",
    "tokcap_vllm.WeightSyncWorker",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]
"""vLLM options of every test server (the CPU engine, fast start)."""

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- m['content'] + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# DeepSeek-R1 style: the generation prompt opens <think>, and history drops the reasoning.
STRIP_REASONING_TEMPLATE = (
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@contextlib.contextmanager
def gate_server(
    model: Path,
    vllm_args: Sequence[str],
    *,
    sink: TokenSink | None = None,
    ledger_dir: Path | None = None,
    start_timeout: float = 600.0,
    **config: Any,
) -> Iterator[InProcessServer]:
    """A gate on vLLM's OpenAI server for the block, configured as the tests' gates are:
    `CONTROL_TOKEN`, token ids returned, a 30 s parent-commit timeout, ``config`` on top,
    its ledger persisted in ``ledger_dir`` when given."""
    ledger_path = str(ledger_dir / "ledger.jsonl") if ledger_dir is not None else None
    gate_config = GateConfig(
        parent_commit_timeout_s=30,
        capture=CaptureConfig(control_token=CONTROL_TOKEN, return_token_ids=True),
        ledger_path=ledger_path,
        **config,
    )
    srv = InProcessServer(str(model), gate=Gate(gate_config, sink=sink), vllm_args=vllm_args)
    srv.start(start_timeout)
    try:
        yield srv
    finally:
        srv.stop()


def client(server: InProcessServer, rollout_id: str) -> openai.AsyncOpenAI:
    """The real OpenAI client, pointed at the rollout's base URL."""
    return openai.AsyncOpenAI(base_url=server.rollout_url(rollout_id), api_key="x", max_retries=0)


async def long_stream(
    c: openai.AsyncOpenAI, server: InProcessServer, max_tokens: int, **options: Any
) -> Any:
    """A streamed chat call that runs ``max_tokens`` tokens (EOS ignored): one to interrupt."""
    return await c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "long story"}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
        **options,
    )


def close_and_reassemble(
    server: InProcessServer, rollout_id: str, *, segments: str = "terminal"
) -> tuple[Any, list[TrainingRow], dict[str, StagedCall]]:
    """Close the rollout on the gate, verify its manifest, build its receipt and rows (sink)."""
    gate = server.gate

    async def run() -> tuple[Any, list[TrainingRow], dict[str, StagedCall]]:
        await gate.close(rollout_id, reward=1.0)
        receipt = assemble_receipt(
            verify_manifest(manifest_of(gate.ledger(rollout_id))), segments=segments
        )  # type: ignore[arg-type]
        keys = [c.staging_key for seg in receipt.segments for c in seg]
        staged = {s.call_id: s for s in await gate.sink.get(keys)} if receipt.ok else {}
        rows = reassemble(receipt, list(staged.values()), max_seq_len=1 << 20) if receipt.ok else []
        return receipt, rows, staged

    return server.call(run)


def events(server: InProcessServer, rollout_id: str) -> list[Any]:
    """The rollout's ledger events (after its in-flight commits settle)."""
    server.call(server.gate.drain)
    return [e.event for e in server.gate.ledger(rollout_id).entries]


def control(server: InProcessServer, **kwargs: Any) -> ControlPlaneClient:
    """A control-plane client of the session gate, holding the right token."""
    return ControlPlaneClient(server.base_url, CONTROL_TOKEN, **kwargs)


def wait_until(
    predicate: Callable[[], bool], what: str, bound_s: float = 120.0, every_s: float = 0.2
) -> None:
    """Poll ``predicate()`` every ``every_s`` (in a thread) until it holds: a hang guard of
    ``bound_s``, not a timing assertion; the test fails naming ``what`` if it never does."""

    async def poll() -> None:
        with anyio.fail_after(bound_s):
            while not await anyio.to_thread.run_sync(predicate):
                await anyio.sleep(every_s)

    try:
        anyio.run(poll)
    except TimeoutError:
        pytest.fail(f"never happened: {what}")
