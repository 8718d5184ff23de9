"""Admission where the tokenizer renders a request straight to token ids (pure; no engine).

``mistral_common`` (vLLM's ``--tokenizer-mode mistral``) has no text template: it encodes a
conversation to ids, with control tokens (``[INST]``, ``[AVAILABLE_TOOLS]``,
``[TOOL_CALLS]``, ``[TOOL_RESULTS]``) that exist in no text. The parent is resolved as the
text planner resolves it (`_plan_text`: the deepest prefix of the new messages,
ending at an assistant message, whose fingerprint is a live call's conversation); the
prompt is formed at the token level from three encodings of the tokenizer::

    B = request(k)       the parent's request, messages[:k], as the tokenizer serves it
    P = history(k + 1)   messages[:k + 1], ending on the parent's assistant message k,
                         that turn closed with its end-of-turn token (``</s>``)
    F = request(n)       the new request (all n messages) as the tokenizer serves it

A tokenizer that cannot encode the finished conversation (``history`` gives None) makes
the call a new root with cause ``template_mismatch``. Two checks make the splice exact
rather than hopeful; either failing is a new root with cause ``template_unstable``
(appending messages re-renders earlier history):
- ``P`` starts with ``B`` and ends with the end-of-turn token, so the assistant turn as the
  tokenizer encodes it is ``T = P[len(B):]``;
- ``F`` starts with ``P``, so ``F[len(P):]`` are the ids of the new messages. Mistral's v3
  tokenizers render the tool list and the system prompt before the *last* user message, so
  a new user turn after tools or a system prompt re-renders history and fails here.

The prompt is ``parent.cum_ids + close + F[len(P):]``, ``close`` being the end-of-turn token
when the generation did not end on it. The call *extends* its parent when
``generated + close == T``; otherwise it is a *splice* (the model's exact ids are kept
although the tokenizer encodes that turn differently, `splice_cause`), or, with
``splice=False``, a new root with cause ``template_mismatch``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from ...fingerprints import message_fingerprints
from ._plan_text import ChatPlan, PriorCall

__all__ = ["HistoryEncoder", "IdEncoder", "plan_chat_ids", "splice_cause"]

IdEncoder = Callable[[int], Sequence[int]]
"""``encode(n) -> ids`` of the request's first ``n`` messages (bound to one request)."""
HistoryEncoder = Callable[[int], Sequence[int] | None]
"""``history(n) -> ids`` of the first ``n`` messages as a finished conversation, or None
when the tokenizer cannot encode them so."""


def splice_cause(
    generated: Sequence[int],
    encoded: Sequence[int],
    *,
    tool_calls: bool,
    special_ids: Container[int],
    decode: Callable[[Sequence[int]], str],
) -> str:
    """Why the tokenizer encodes an assistant turn (``encoded``) other than it was generated.

    Both sequences exclude the end-of-turn token. In order: ``tool_call_format`` (the turn
    has tool calls: Mistral's encoding adds the call ids and re-serialises the arguments),
    ``special_tokens`` (control tokens the returned content cannot carry),
    ``invalid_utf8`` (bytes that decode to U+FFFD), ``whitespace`` (the same text but for
    whitespace, e.g. the trailing spaces ``mistral_common`` strips) and ``other`` (above all
    the same text tokenised differently: decode then encode is not the identity).
    """
    if tool_calls:
        return "tool_call_format"
    if [t for t in generated if t in special_ids] != [t for t in encoded if t in special_ids]:
        return "special_tokens"
    text = decode(generated)
    if "\ufffd" in text:
        return "invalid_utf8"
    if "".join(text.split()) == "".join(decode(encoded).split()) and text != decode(encoded):
        return "whitespace"
    return "other"


def plan_chat_ids(
    messages: Sequence[Mapping[str, Any]],
    *,
    priors: Sequence[PriorCall],
    request: IdEncoder,
    history: HistoryEncoder,
    end_of_turn: int,
    special_ids: Container[int],
    decode: Callable[[Sequence[int]], str],
    splice: bool = True,
) -> ChatPlan:
    """Resolve the parent of a chat call among ``priors`` and build its exact prompt ids.

    ``messages`` are the request's normalised messages (`normalize_message`, for the
    fingerprints); ``request(n)`` and ``history(n)`` encode its first ``n`` raw messages
    (see the module docstring). Every prior needs ``gen_len`` (its generated ids are the
    last ``gen_len`` of ``cum_ids``); a prior without it is never a parent.
    """
    fps = message_fingerprints(messages)
    request_fp = fps[-1] if fps else hashlib.sha256(b"tokcap/conversation/v1").hexdigest()
    full = list(request(len(messages)))
    by_fp: dict[str, PriorCall] = {}
    for prior in priors:
        if prior.kind == "chat" and prior.conversation_fp is not None and prior.gen_len:
            by_fp[prior.conversation_fp] = prior  # latest wins
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] != "assistant" or fps[k] not in by_fp:
            continue
        parent = by_fp[fps[k]]
        closed = history(k + 1)
        if closed is None:
            return _root(full, request_fp, "template_mismatch")
        before, prefix = list(request(k)), list(closed)
        stable = (
            prefix[: len(before)] == before
            and len(prefix) > len(before)
            and prefix[-1] == end_of_turn
            and full[: len(prefix)] == prefix
        )
        if not stable:
            return _root(full, request_fp, "template_unstable")
        cum = list(parent.cum_ids)
        generated = cum[len(cum) - parent.gen_len :]
        close = [] if generated[-1] == end_of_turn else [end_of_turn]
        turn = prefix[len(before) :]
        formation, cause = "extend", None
        if generated + close != turn:
            if not splice:
                return _root(full, request_fp, "template_mismatch")
            body = generated[:-1] if not close else generated
            formation = "splice"
            cause = splice_cause(
                body,
                turn[:-1],
                tool_calls=bool(messages[k].get("tool_calls")),
                special_ids=special_ids,
                decode=decode,
            )
        return ChatPlan(
            parent_id=parent.call_id,
            prefix_len=len(cum),
            prompt_ids=cum + close + full[len(prefix) :],
            prompt_text="",
            request_fingerprint=request_fp,
            formation=formation,
            splice_cause=cause,
        )
    return _root(full, request_fp, "no_parent_match" if priors else None)


def _root(full: list[int], request_fp: str, cause: str | None) -> ChatPlan:
    return ChatPlan(
        parent_id=None,
        prefix_len=0,
        prompt_ids=full,
        prompt_text="",
        break_cause=cause,
        request_fingerprint=request_fp,
    )
