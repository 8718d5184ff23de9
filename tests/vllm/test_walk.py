"""The walk of one rollout id through the code, on the session's gate (``bench/walk_rollout.py``).

Two turns over HTTP with the openai client, the trainer's close, the staged rows read back
and reassembled, measured two ways (the bench's docstring): following the rollout id
itself, and following what holds it too (its calls, its record, its close).

Issue #32's bars hold following the rollout id itself: at most 25 modules end to end, at
most 3 returns to a module already left per request (measured when these bounds were
set: 24 modules; 2, 2 and 2 returns for the two turns and the close). Following what holds
it too, the figures must not grow back (measured: 30 modules, 15 returns per turn, 4 for
the close; 33, 15 and 6 before the close told its observers in one place and the
verification, reassembly and group modules became one). What remains there per turn is
one hand-over per event (driver -> book -> driver) and the two observers told each entry.
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
REQUESTS = ("turn 1", "turn 2", "close")


def test_a_rollout_walks_from_the_request_to_a_row_through_one_owner_of_its_events(
    server: InProcessServer,
) -> None:
    walks = load_bench("walk_rollout").walk(server, CONTROL_TOKEN, "walk-1")
    every, itself = _documented_walk()
    # the same modules (the order of first reach may move with threads: not checked)
    assert sorted(walks.held.modules) == sorted(every), walks.held.modules
    assert sorted(walks.itself.modules) == sorted(itself), walks.itself.modules
    # issue #32's bars, following the rollout id itself
    assert len(walks.itself.modules) <= 25, walks.itself.modules
    for request in REQUESTS:
        assert walks.itself.returns[request] <= 3, (request, walks.itself.stays[request])
    # following what holds it too: no growing back
    held = walks.held
    assert len(held.modules) <= 30, held.modules
    assert held.modules[:3] == [
        "tokcap_vllm.server._inproc",
        "tokcap_vllm.gate._routing",
        "tokcap_core.ids",
    ]
    assert held.modules[-1] == "tokcap_core.metrics"  # the reassembled group's metrics
    for turn in ("turn 1", "turn 2"):
        stays = held.stays[turn]
        assert held.returns[turn] <= 15, (turn, stays)
        # the door twice: the request, and its last byte
        assert stays.count("tokcap_vllm.server._middleware") == 2, stays
        for before, after in itertools.pairwise(stays):
            assert not {before, after} <= DOOR | BOOK or not ({before, after} & BOOK), (
                f"the door and the book met: {before} -> {after}"
            )
        assert set(stays) & BOOK == {"tokcap_vllm.gate._lifecycle"}  # a call's events
    assert held.returns["close"] <= 4, held.stays["close"]
    assert "tokcap_vllm.server._middleware" not in held.stays["close"]
    assert "tokcap_vllm.gate._rollouts" in held.stays["close"]  # a rollout's events
    # every observer is told the close in one place
    assert "tokcap_vllm.persist._hooks" in walks.itself.stays["close"]
    assert "tokcap_vllm.gate._gate" not in walks.itself.stays["close"][2:]


def _documented_walk() -> tuple[list[str], list[str]]:
    """The modules docs/ARCHITECTURE.md's measured walk lists, in its order: all of them,
    and those the rollout id itself reaches."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The walk, measured", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_.]+)` \| (yes|) \|", section, re.MULTILINE)
    return [m for m, _ in rows], [m for m, mark in rows if mark == "yes"]
