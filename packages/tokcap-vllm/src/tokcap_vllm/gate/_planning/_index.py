"""The parent index: what a rollout's calls returned, and the next prompt planned from it (pure).

One owner per rollout (`ParentIndex`, held by its `RolloutRecord`). The middleware hands
the gate what it observed going out (`Observed`); the gate asks the index to `learn` it
(decoding the output ids, fingerprinting the returned message, building the `PriorCall`)
and, for the next call, to plan it (`ParentIndex.planner`: a snapshot of the parents and
the request's `Planner`, run in a worker thread). Text and id-level planners
(`_render_text.RequestRenderer`, `_render_ids.IdRequestRenderer`) both
answer a request with one `PlannedRequest`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...fingerprints import (
    image_blind_fingerprints,
    message_fingerprints,
    normalize_message,
    output_fingerprint,
)
from ._plan_text import ChatPlan, PriorCall

if TYPE_CHECKING:
    from .._host import EngineResult

__all__ = ["Learned", "Observed", "ParentIndex", "PlannedRequest", "Planner"]

Planner = Callable[[list[PriorCall], dict[str, int]], ChatPlan]
"""``plan(priors, gen_starts) -> ChatPlan``: resolves the parent and forms the prompt."""


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request, bound to the server's tokenizer: how to plan it and read its output."""

    messages: list[dict[str, Any]] | None
    """The normalised chat messages (None for a completion)."""
    plan: Planner
    decode: Callable[[Sequence[int]], str]
    """Generated ids as text, special tokens kept (what the parent's turn was)."""
    images: tuple[str, ...] = ()
    """The SHA-256 of each image in ``messages``, in prompt order (a model that takes
    images; none otherwise)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What the harness received, as the middleware saw it go out."""

    response_id: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    answer: tuple[dict[str, Any], list[bytes]] | None = None
    """The recorded answer, for a retry under the same idempotency key."""


@dataclass(frozen=True, slots=True)
class Learned:
    """What the index learned of one call: its output fingerprint and its parent record."""

    output_fp: str
    prior: PriorCall


class ParentIndex:
    """A rollout's responded calls that may be parents, oldest first."""

    __slots__ = ("_gen_starts", "_priors")

    def __init__(self) -> None:
        self._priors: list[PriorCall] = []
        self._gen_starts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._priors)

    def __contains__(self, prior: object) -> bool:
        return prior in self._priors

    def add(self, prior: PriorCall, gen_start: int) -> None:
        """Index ``prior``; its generated text starts at ``gen_start`` of its ``cum_text``."""
        self._priors.append(prior)
        self._gen_starts[prior.call_id] = gen_start

    def forget(self, prior: PriorCall) -> None:
        """A parent whose call failed after responding is a parent no more."""
        if prior in self._priors:
            self._priors.remove(prior)

    def planner(self, request: PlannedRequest) -> Callable[[], ChatPlan]:
        """``request``'s plan over the parents indexed now (safe to run in another thread)."""
        priors, gen_starts, plan = list(self._priors), dict(self._gen_starts), request.plan
        return lambda: plan(priors, gen_starts)

    @staticmethod
    def learn(
        request: PlannedRequest,
        *,
        call_id: str,
        kind: str,
        plan: ChatPlan,
        result: EngineResult,
        seen: Observed,
    ) -> Learned:
        """What a call that returned ``result`` (seen as ``seen``) leaves for its children."""
        output_fp = output_fingerprint(seen.content, seen.tool_calls)
        conversation_fp = image_blind = None
        if kind == "chat":
            cum_text = plan.prompt_text + request.decode(result.output_ids)
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": seen.content,
                "tool_calls": seen.tool_calls,
            }
            turn = normalize_message(assistant)
            conversation = [*(request.messages or []), turn]
            conversation_fp = message_fingerprints(conversation)[-1]
            if request.images:
                image_blind = image_blind_fingerprints(conversation)[-1]
        else:
            cum_text = plan.prompt_text + result.text if plan.prompt_text else ""
        cum_ids = array("I", result.prompt_ids)
        cum_ids.extend(result.output_ids)
        prior = PriorCall(
            call_id,
            kind,
            cum_text,
            cum_ids,
            conversation_fp,
            gen_len=len(result.output_ids),
            image_blind=image_blind,
        )
        return Learned(output_fp, prior)

    def snapshot(self) -> tuple[list[PriorCall], Mapping[str, int]]:
        """The parents and where their generated text starts (for tests and tools)."""
        return list(self._priors), dict(self._gen_starts)
