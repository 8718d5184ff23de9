"""What the engine-free tests of the gate's rules hand a `RolloutBook` instead of anyio's,
and the events that bring a call to its admission."""

from __future__ import annotations

from array import array
from typing import Any

from tokcap_core import Entry
from tokcap_core.provenance import VersionSpan
from tokcap_vllm.gate._host import EngineResult
from tokcap_vllm.gate._planning import ChatPlan, PlannedRequest
from tokcap_vllm.gate._records import GateCall
from tokcap_vllm.gate._rollouts import RolloutBook


class Flag:
    """A plain flag standing in for the driver's ``anyio.Event`` (the rules only set it)."""

    def __init__(self) -> None:
        self.count = 0

    def set(self) -> None:
        self.count += 1

    def is_set(self) -> bool:
        return self.count > 0

    async def wait(self) -> None:  # the rules never wait
        raise AssertionError("the rules never wait")


class NoLock:
    """The driver's planning lock, never entered by the rules."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def plan(parent_id: str | None = None, text: str = "prompt") -> ChatPlan:
    """A plan as the planner makes one: a root, or an extension of ``parent_id``."""
    formation = "root" if parent_id is None else "extend"
    prefix = 0 if parent_id is None else 2
    return ChatPlan(
        parent_id, prefix, [1, 2, 3], text, request_fingerprint="fp", formation=formation
    )


REQUEST = PlannedRequest(None, lambda *_: plan(), lambda ids: "")
"""A request whose plan the tests give the book themselves."""


def result(finish_reason: str = "stop", prompt_ids: list[int] | None = None) -> EngineResult:
    """An engine result of two generated tokens."""
    return EngineResult(
        prompt_ids=prompt_ids if prompt_ids is not None else [1, 2, 3],
        output_ids=array("I", [4, 5]),
        logprobs=array("f", [-0.5, -0.25]),
        finish_reason=finish_reason,
        weight_version=0,
        weight_version_last=0,
        weight_versions=(VersionSpan(version=0, start=0, end=2),),
        text="xy",
    )


def admitted(book: RolloutBook, rollout_id: str, **claims: Any) -> GateCall:
    """A call of ``rollout_id`` received, holding its claims, and admitted as a root: the
    events the capture path tells the book up to its ``Admitted`` entry."""
    call = book.call_received(rollout_id, kind=claims.pop("kind", "chat"), **claims)
    assert book.call_claimed(call) is None
    book.call_planning(call, REQUEST)
    assert isinstance(book.call_planned(call, plan(), admitted_at=1, unserved=None), Entry)
    return call
