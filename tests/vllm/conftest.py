"""One vLLM CPU engine + the gate for the whole tests/vllm session (fast-start mode).

The tiny model comes from ``tokcap.tiny`` (ChatML template, built locally, cached).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.engine_env import set_cpu_engine_env

set_cpu_engine_env()

from tests.vllm._helpers import VLLM_ARGS, gate_server  # noqa: E402
from tokcap_core import MemorySink, SinkError, StagedCall  # noqa: E402
from tokcap_vllm import InProcessServer  # noqa: E402


class FailingSink(MemorySink):
    """The real `MemorySink`, wrapped to fail every put for rollouts named ``fail-*``."""

    async def put(self, calls: Sequence[StagedCall]) -> None:
        if any(c.rollout_id.startswith("fail-") for c in calls):
            raise SinkError("injected_put_failure", "this test sink refuses rollouts named fail-*")
        await super().put(calls)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokcap.tiny import build_tiny_model

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return build_tiny_model(cache / "dense", kind="dense")


@pytest.fixture(scope="session")
def vlm() -> Path:
    """The tiny Idefics3 (`tokcap.tiny.build_tiny_vlm`, cached)."""
    from tokcap.tiny import build_tiny_vlm

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    return build_tiny_vlm(cache / "vlm")


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The gate (control token set, ledger persisted to a file) on vLLM's OpenAI server."""
    ledger_dir = tmp_path_factory.mktemp("gate")
    with gate_server(tiny_model, VLLM_ARGS, sink=FailingSink(), ledger_dir=ledger_dir) as srv:
        yield srv
