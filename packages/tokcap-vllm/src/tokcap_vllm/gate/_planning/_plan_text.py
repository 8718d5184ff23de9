"""Admission on rendered text: parent resolution and suffix rendering (pure; no I/O, no engine).

A chat call's parent is the latest live call whose *conversation after it* (its request
messages + the assistant message it returned) equals a prefix of the new messages ending at
an assistant message; the deepest such prefix wins (fingerprints on normalised messages:
`tokcap_vllm.fingerprints`).

On a match the child is formed on the parent's exact cumulative ids
(`_splice`): *extended* by what the template renders after the parent's exact
text, or *spliced* to the tokenised new messages where the template renders the parent's
turn differently from what it generated (special tokens, invalid UTF-8, re-serialised tool
calls, whitespace). Only a history the harness really changed, a template that re-renders
earlier turns, or reasoning the template strips (unless the gate keeps the model's own
reasoning tokens) makes the call a new root, with a break cause (`BREAK_CAUSES`). A request
that names no call only because an image changed (other bytes where a call's conversation
had an image, an image added or moved: ``image_changed``) or because images of that
conversation were left out (``image_dropped``) says so, by the conversations' fingerprints
blind to images (`tokcap_vllm.fingerprints.image_blind_fingerprints`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...fingerprints import ImageBlind, _canonical, image_blind_fingerprints, message_fingerprints
from ._splice import ChildTurn, Renderer, SpliceRules, form_child

__all__ = [
    "ChatPlan",
    "PriorCall",
    "Renderer",
    "plan_chat",
    "plan_completion",
]

Encoder = Callable[[str], list[int]]


@dataclass(slots=True)
class PriorCall:
    """What admission needs to know about an earlier call of the rollout."""

    call_id: str
    kind: str
    cum_text: str
    cum_ids: Sequence[int]
    conversation_fp: str | None = None
    """Chat only: fingerprint of the request messages + the returned assistant message."""
    gen_len: int = 0
    """How many of ``cum_ids`` the call generated (its last ones; the id-level planner's)."""
    image_blind: ImageBlind | None = None
    """Chat only: the conversation's fingerprints blind to its images (None: it has none)."""


@dataclass(slots=True)
class ChatPlan:
    """Admission's answer: the parent (None: root), the exact engine prompt, and the text it is.

    ``formation`` says how the prompt was formed: ``"root"`` (no parent; ``break_cause``
    says why when the rollout had calls before), ``"extend"`` (the rendered history starts
    with the parent's exact text) or ``"splice"`` (the parent's exact ids, then the
    tokenised new messages; ``splice_cause`` says why the template's rendering differed).
    """

    parent_id: str | None
    prefix_len: int
    prompt_ids: list[int]
    prompt_text: str
    break_cause: str | None = None
    request_fingerprint: str = ""
    formation: str = "root"
    splice_cause: str | None = None


def plan_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    priors: Sequence[PriorCall],
    gen_starts: Mapping[str, int],
    render: Renderer,
    encode: Encoder,
    add_generation_prompt: bool,
    rules: SpliceRules | None = None,
) -> ChatPlan:
    """Resolve the parent of a chat call among ``priors`` and build its exact prompt.

    ``priors`` are the rollout's live chat calls, oldest first; ``gen_starts[call_id]`` is
    where that call's generated text starts in its ``cum_text`` (its prompt as the template
    rendered it comes before). The deepest assistant message whose conversation
    fingerprint names a prior is the parent; how the child extends it (or breaks) is
    `_splice.form_child`'s answer. ``prompt_text`` is always the template's
    rendering of the request: what later calls compare their history with.
    """
    fps = message_fingerprints(messages)
    request_fp = fps[-1] if fps else hashlib.sha256(b"tokcap/conversation/v1").hexdigest()
    full = render(messages, add_generation_prompt)
    by_fp: dict[str, PriorCall] = {}
    for prior in priors:
        if prior.kind == "chat" and prior.conversation_fp is not None:
            by_fp[prior.conversation_fp] = prior  # latest wins
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] != "assistant" or fps[k] not in by_fp:
            continue
        parent = by_fp[fps[k]]
        gen_start = gen_starts.get(parent.call_id, len(parent.cum_text))
        child = ChildTurn(
            messages=messages,
            k=k,
            prompt_text=parent.cum_text[:gen_start],
            generated=parent.cum_text[gen_start:],
            full=full,
            render=render,
            rules=rules or SpliceRules(),
        )
        formed = form_child(child)
        if formed.formation is None:
            return _root(encode(full), full, request_fp, formed.break_cause)
        return _child(
            parent, encode(formed.carry), full, request_fp, formed.formation, formed.splice_cause
        )
    cause = _image_cause(messages, priors) if priors else None
    return _root(encode(full), full, request_fp, cause or ("no_parent_match" if priors else None))


def _image_cause(messages: Sequence[Mapping[str, Any]], priors: Sequence[PriorCall]) -> str | None:
    """``image_changed`` or ``image_dropped`` when a prefix of ``messages`` ending at an
    assistant message is a prior's conversation but for its images (None otherwise)."""
    known = [p.image_blind for p in priors if p.image_blind is not None]
    if not known:
        return None
    blind = image_blind_fingerprints(messages)
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] != "assistant":
            continue
        for prior in known:
            if blind[k].places == prior.places:
                return "image_changed"
            if blind[k].text == prior.text:
                return "image_dropped" if blind[k].images < prior.images else "image_changed"
    return None


def _root(ids: list[int], text: str, request_fp: str, cause: str | None) -> ChatPlan:
    return ChatPlan(
        parent_id=None,
        prefix_len=0,
        prompt_ids=ids,
        prompt_text=text,
        break_cause=cause,
        request_fingerprint=request_fp,
    )


def _child(
    parent: PriorCall,
    carry: Sequence[int],
    text: str,
    request_fp: str,
    formation: str,
    splice_cause: str | None = None,
) -> ChatPlan:
    """The plan on ``parent``'s exact ids followed by ``carry``."""
    return ChatPlan(
        parent_id=parent.call_id,
        prefix_len=len(parent.cum_ids),
        prompt_ids=[*parent.cum_ids, *carry],
        prompt_text=text,
        request_fingerprint=request_fp,
        formation=formation,
        splice_cause=splice_cause,
    )


def plan_completion(
    prompt: str | Sequence[int], *, priors: Sequence[PriorCall], encode: Encoder
) -> ChatPlan:
    """A completion call's parent: the longest earlier cumulative text (or ids) it extends."""
    is_text = isinstance(prompt, str)
    raw = prompt.encode() if isinstance(prompt, str) else _canonical(list(prompt))
    request_fp = hashlib.sha256(b"tokcap/completion/v1" + raw).hexdigest()
    best: PriorCall | None = None
    for prior in priors:
        if prior.kind != "completion":
            continue
        if isinstance(prompt, str):
            hit = prompt.startswith(prior.cum_text) and len(prompt) > len(prior.cum_text)
            size = len(prior.cum_text)
        else:
            n = len(prior.cum_ids)
            hit = len(prompt) > n and list(prompt[:n]) == list(prior.cum_ids)
            size = n
        if hit and (best is None or size >= (len(best.cum_text) if is_text else len(best.cum_ids))):
            best = prior
    text = prompt if isinstance(prompt, str) else ""
    if best is None:
        ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        cause = "no_parent_match" if any(p.kind == "completion" for p in priors) else None
        return _root(ids, text, request_fp, cause)
    if isinstance(prompt, str):
        carry = encode(prompt[len(best.cum_text) :])
    else:
        carry = list(prompt[len(best.cum_ids) :])
    return _child(best, carry, text, request_fp, "extend")
