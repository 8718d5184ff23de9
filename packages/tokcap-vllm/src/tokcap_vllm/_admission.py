"""Admission: fingerprints, parent resolution and suffix rendering (pure; no I/O, no engine).

A chat call's parent is the latest live call whose *conversation after it* (its request
messages + the assistant message it returned) equals a prefix of the new messages ending at
an assistant message; the deepest such prefix wins. Messages are normalised first (content
parts joined, tool-call arguments re-serialised canonically, ids dropped) so a harness that
re-encodes JSON still matches.

On a match the child is formed on the parent's exact cumulative ids
(`tokcap_vllm._splice`): *extended* by what the template renders after the parent's exact
text, or *spliced* to the tokenised new messages where the template renders the parent's
turn differently from what it generated (special tokens, invalid UTF-8, re-serialised tool
calls, whitespace). Only a history the harness really changed, a template that re-renders
earlier turns, or reasoning the template strips (unless the gate keeps the model's own
reasoning tokens) makes the call a new root, with a break cause (`BREAK_CAUSES`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import BadRequest
from ._splice import Renderer, SpliceRules, form_child

__all__ = [
    "ChatPlan",
    "PriorCall",
    "Renderer",
    "message_fingerprints",
    "normalize_message",
    "output_fingerprint",
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


def _text_of(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise BadRequest("unsupported_content", "only text content parts can be captured")
        return "\n".join(parts)
    raise BadRequest("bad_body", "message content must be a string, a list of parts or null")


def _arguments(value: object) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
        except RecursionError:
            raise _too_deep("tool-call arguments") from None
    return value


def _too_deep(what: str) -> BadRequest:
    # Python's JSON codecs recurse: nesting near the interpreter's recursion limit (~1,000)
    # raises RecursionError, which must answer as the caller's mistake, never a 500.
    return BadRequest("bad_json", f"{what} nested too deeply")


def normalize_message(message: object) -> dict[str, Any]:
    """The fields of a chat message that identify it (and feed the template), canonically."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise BadRequest("bad_body", "every message must be an object with a string role")
    out: dict[str, Any] = {"role": message["role"], "content": _text_of(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise BadRequest("bad_body", "tool_calls must be a list")
        norm = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping):
                raise BadRequest("bad_body", "a tool call needs a function object")
            norm.append(
                {
                    "type": "function",
                    "function": {
                        "name": fn.get("name"),
                        "arguments": _arguments(fn.get("arguments")),
                    },
                }
            )
        out["tool_calls"] = norm
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _canonical(obj: object) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except RecursionError:
        raise _too_deep("a message") from None


def message_fingerprints(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """Rolling fingerprints: element ``i`` covers ``messages[: i + 1]`` (hex SHA-256)."""
    out, prev = [], b"tokcap/conversation/v1"
    for message in messages:
        digest = hashlib.sha256(prev + _canonical(message)).digest()
        out.append(digest.hex())
        prev = digest
    return out


def output_fingerprint(
    content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """Fingerprint of one returned assistant message (content and tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return hashlib.sha256(b"tokcap/output/v1" + _canonical(normalize_message(message))).hexdigest()


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
    `tokcap_vllm._splice.form_child`'s answer. ``prompt_text`` is always the template's
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
        formed = form_child(
            messages,
            k,
            prompt_text=parent.cum_text[:gen_start],
            generated=parent.cum_text[gen_start:],
            full=full,
            render=render,
            rules=rules or SpliceRules(),
        )
        if formed.formation is None:
            return _root(full, encode, request_fp, formed.break_cause)
        prompt_ids = list(parent.cum_ids)
        prompt_ids.extend(encode(formed.carry))
        return ChatPlan(
            parent_id=parent.call_id,
            prefix_len=len(parent.cum_ids),
            prompt_ids=prompt_ids,
            prompt_text=full,
            request_fingerprint=request_fp,
            formation=formed.formation,
            splice_cause=formed.splice_cause,
        )
    return _root(full, encode, request_fp, "no_parent_match" if priors else None)


def _root(full: str, encode: Encoder, request_fp: str, cause: str | None) -> ChatPlan:
    return ChatPlan(
        parent_id=None,
        prefix_len=0,
        prompt_ids=encode(full),
        prompt_text=full,
        break_cause=cause,
        request_fingerprint=request_fp,
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
        return ChatPlan(
            parent_id=None,
            prefix_len=0,
            prompt_ids=ids,
            prompt_text=text,
            break_cause=cause,
            request_fingerprint=request_fp,
        )
    ids = list(best.cum_ids)
    if isinstance(prompt, str):
        ids.extend(encode(prompt[len(best.cum_text) :]))
    else:
        ids.extend(prompt[len(best.cum_ids) :])
    return ChatPlan(
        parent_id=best.call_id,
        prefix_len=len(best.cum_ids),
        prompt_ids=ids,
        prompt_text=text,
        request_fingerprint=request_fp,
        formation="extend",
    )
