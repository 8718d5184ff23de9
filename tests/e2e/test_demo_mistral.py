"""``tokcap demo --quick --model-family mistral``: a Mistral-family model served as its users
serve it (``--tokenizer-mode mistral``, the ``mistral`` tool parser, the real Tekken
tokenizer ``mistral_common`` ships), run as a user runs it: one subprocess, real vLLM,
TransferQueue and Ray. Every tool loop is one verified chain, token-exact with the engine.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e._cli import tokcap

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("demo-mistral") / "run"
    proc = tokcap(
        "demo", "--quick", "--model-family", "mistral", "--out", out, timeout=DEMO_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "mistral" in proc.stdout  # the summary names the family it served
    loaded: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return loaded


def test_it_served_the_mistral_family(summary: dict[str, Any]) -> None:
    assert summary["config"]["family"] == "mistral"
    assert summary["rollouts"] == {"total": 8, "verified": 8, "poisoned": 0, "groups": 2}


def test_every_tool_loop_is_one_chain(summary: dict[str, Any]) -> None:
    """Tool calls on every turn but the last, Mistral's format, echoed back with Mistral's
    call ids: each follow-up is a ``tool_call_format`` splice, never a break. Only the
    rollouts whose harness rewrites its history break (``no_parent_match``)."""
    for r in summary["per_rollout"]:
        assert r["tool_calls"] >= 3, r  # two in parallel on the first turn, one on the second
        if r["behaviour"] == "rewrite":
            assert r["breaks"] == ["no_parent_match"], r
            assert r["on_chain"] == r["calls"] - 1, r
        else:
            assert r["breaks"] == [], r
            assert r["on_chain"] == r["calls"] == 3, r
            assert r["splices"] == ["tool_call_format"] * 2, r
    assert summary["breaks"]["template_unstable"] == 0


def test_rows_are_exactly_what_the_engine_reported(summary: dict[str, Any]) -> None:
    parity, rows = summary["engine_parity"], summary["rows"]
    assert rows["verified"] == rows["valid"] == rows["total"] == 8
    assert parity["rows_checked"] == 8
    assert parity["calls_checked"] == summary["calls"]["on_terminal_chain"] == 22
    assert parity["rows_differing"] == 0
    assert parity["max_logprob_abs_diff"] <= 1e-6


def test_retokenizing_through_mistral_common_would_have_drifted(summary: dict[str, Any]) -> None:
    """Re-encoding the transcript (mistral_common, as a text-based trainer would) changes
    the ids of rows whose calls carry tool calls."""
    drifted = [r for r in summary["per_rollout"] if r["drift_at"] is not None]
    assert drifted
