"""The walk of one rollout id through the code, on the session's gate (``bench/walk_rollout.py``).

Two turns over HTTP with the openai client, the trainer's close, the staged rows read back
and reassembled: the figures must not grow back. Measured when these bounds were set
(issue #32's refactor: the rollout book owns every event, the door reads nothing of the
call): 33 modules end to end; inside the gate, 25 stays and 15 returns to a module already
left per turn, 15 stays and 6 returns for the close (before: 33 modules; 47/37 and 45/35
per turn, 20/10 for the close); image capture (issue #35) reads a call's images in the
renderer, so a text-only turn makes no extra visit. What
remains per turn is one hand-over per event (driver -> book -> driver) and the two
observers told each entry (the ledger file, the metrics); the issue's targets (at most 3
returns, at most 25 modules) are not met.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tests.benches import load_bench
from tests.vllm._helpers import CONTROL_TOKEN
from tokcap_vllm import InProcessServer

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOOR = {"tokcap_vllm.server._middleware", "tokcap_vllm.gate._routing", "tokcap_vllm.gate._apis"}
BOOK = {"tokcap_vllm.gate._rollouts", "tokcap_vllm.gate._lifecycle"}


def test_a_rollout_walks_from_the_request_to_a_row_through_one_owner_of_its_events(
    server: InProcessServer,
) -> None:
    walk = load_bench("walk_rollout").walk(server, CONTROL_TOKEN, "walk-1")
    # the same modules (the order of first reach may move with threads: not checked)
    assert sorted(walk.modules) == sorted(_documented_walk()), walk.modules
    assert len(walk.modules) <= 33, walk.modules
    assert walk.modules[:3] == [
        "tokcap_vllm.server._inproc",
        "tokcap_vllm.gate._routing",
        "tokcap_core.ids",
    ]
    assert walk.modules[-1] == "tokcap_core.metrics"  # the reassembled group's metrics
    for turn in ("turn 1", "turn 2"):
        stays = walk.stays[turn]
        assert walk.returns[turn] <= 15, (turn, stays)
        # the door twice: the request, and its last byte
        assert stays.count("tokcap_vllm.server._middleware") == 2, stays
        for before, after in itertools.pairwise(stays):
            assert not {before, after} <= DOOR | BOOK or not ({before, after} & BOOK), (
                f"the door and the book met: {before} -> {after}"
            )
        assert set(stays) & BOOK == {"tokcap_vllm.gate._lifecycle"}  # a call's events
    assert walk.returns["close"] <= 6, walk.stays["close"]
    assert "tokcap_vllm.server._middleware" not in walk.stays["close"]
    assert "tokcap_vllm.gate._rollouts" in walk.stays["close"]  # a rollout's events


def _documented_walk() -> list[str]:
    """The modules docs/ARCHITECTURE.md's measured walk lists, in its order."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The walk, measured", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_.]+)` \|", section, re.MULTILINE)
