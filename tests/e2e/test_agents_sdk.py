"""An OpenAI Agents SDK agent as the harness, through gates started by hand.

``examples/agents_sdk_harness.py`` runs as a user runs it, in its own process, against the
shared fleet's two ``tokcap-vllm serve`` gates (``served_fleet``, tests/conftest.py):
the SDK's own ``Runner`` drives an agent with a ``calc`` tool over chat completions and
over the Responses API, two rollouts each. The example's ``--report`` gives what it saw;
this test checks it from the raw material, not from the example's own verdict:

- the SDK's run result shows two tool calls and two model calls per agent;
- the receipt verified, and its one segment holds every call the SDK made (all on one
  chain, the terminal segment covering them);
- the row is the engine's ids: the ids vLLM reported to the harness over HTTP with each
  answer (``return_token_ids`` on chat, ``enable_response_messages`` on Responses) are,
  call after call, prefixes of the row, the last call's prompt and output are the whole
  row, and the loss mask is 1 exactly on what the engine generated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._fleet import SharedFleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 900


@pytest.fixture(scope="module")
def seen(served_fleet: SharedFleet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example's report of one run: two chat and two Responses agents."""
    report = tmp_path_factory.mktemp("agents") / "report.json"
    gates = [arg for url in served_fleet.urls for arg in ("--gate", url)]
    command = [
        sys.executable, str(REPO / "examples" / "agents_sdk_harness.py"),
        "--ray-address", served_fleet.address, *gates, "--rollouts", "2", "--report", str(report),
    ]  # fmt: skip
    env = {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "TOKCAP_CONTROL_TOKEN": served_fleet.token,
    }
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "receipts verified 4/4" in proc.stdout, proc.stdout
    out: dict[str, Any] = json.loads(report.read_text())
    return out


def test_both_apis_ran_two_agents_each(seen: dict[str, Any]) -> None:
    assert sorted(r["api"] for r in seen.values()) == ["chat", "chat", "responses", "responses"]


def test_each_agent_made_two_tool_calls_then_answered(seen: dict[str, Any]) -> None:
    for rollout_id, r in seen.items():
        assert len(r["tool_calls"]) == 2, rollout_id
        assert all(set(json.loads(args)) == {"a", "op", "b"} for args in r["tool_calls"])
        assert r["model_calls"] == 2, rollout_id  # the tool calls' turn, then the answer
        assert r["final_output"].isdigit(), r["final_output"]
        assert len(r["engine"]) == 2, rollout_id  # every model call answered over HTTP


def test_every_call_is_on_one_verified_chain(seen: dict[str, Any]) -> None:
    for rollout_id, r in seen.items():
        receipt = r["receipt"]
        assert receipt["status"] == "verified", (rollout_id, receipt["failure_reason"])
        assert receipt["terminal_selection"] == "response_id"
        [segment] = receipt["segments"]  # one segment: no break in the agent's history
        assert len(segment) == r["model_calls"], rollout_id
        assert segment[0]["formation"] == "root"
        assert [c["parent_id"] for c in segment[1:]] == [c["call_id"] for c in segment[:-1]]
        assert receipt["terminal_call_id"] == segment[-1]["call_id"]
        assert r["row"]["call_ids"] == [c["call_id"] for c in segment]


def test_rows_are_the_engines_ids(seen: dict[str, Any]) -> None:
    for rollout_id, r in seen.items():
        row = r["row"]
        assert row["sample_mask"] == 1, rollout_id
        ids: list[int] = row["input_ids"]
        generated: set[int] = set()
        for call in r["engine"]:
            prompt, output = call["prompt_ids"], call["output_ids"]
            assert prompt, rollout_id  # the engine reported ids for this call
            assert output, rollout_id
            assert ids[: len(prompt) + len(output)] == prompt + output, rollout_id
            generated.update(range(len(prompt), len(prompt) + len(output)))
        last = r["engine"][-1]
        assert ids == last["prompt_ids"] + last["output_ids"], rollout_id
        assert [i for i, m in enumerate(row["loss_mask"]) if m] == sorted(generated), rollout_id
