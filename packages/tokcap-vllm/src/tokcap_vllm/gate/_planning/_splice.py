"""Forming a child's prompt on its parent's exact ids: extend, splice or break (pure).

For a parent ``P`` found by message fingerprints at the assistant message ``k`` of the
new request, with ``T`` = ``P``'s prompt as the chat template rendered it (history +
generation prompt) and ``G`` = ``P``'s generated ids decoded with special tokens:

- ``H = render(messages[:k + 1])`` is the history up to ``P``'s turn as the template
  renders it now, ``A = H[len(T):]`` the template's rendering of ``P``'s turn and
  ``full = render(messages)`` the new request;
- **extend**: ``H`` starts with ``T``, ``A`` starts with ``G`` and ``full`` with ``H``: the
  prompt is ``P``'s cumulative ids + ``encode(full[len(T) + len(G):])`` (what the template
  renders after the model's exact text);
- **splice**: as above but ``A`` does not start with ``G`` (special tokens the returned
  content omits, bytes that decode to U+FFFD, re-serialised tool calls, stripped
  whitespace): the prompt is ``P``'s cumulative ids + ``encode(close + full[len(H):])``,
  ``close`` being the text the template closes an assistant turn with (found by rendering
  a probe turn); its leading end-of-turn token is left out when ``G`` already ends on it;
- **reasoning** the template drops from ``P``'s turn (a marker such as ``<think>`` that
  ``G`` or ``T`` holds and the re-rendering lacks): with ``reasoning="follow_template"``
  a break (``reasoning_stripped``), with ``"keep_model_tokens"`` a splice whose new
  messages are read off ``full`` with a probe in place of ``P``'s turn;
- **break** otherwise: ``history_rewritten`` (``H`` does not start with ``T``: the history
  before ``P``'s turn changed), ``template_unstable`` (appending the new messages
  re-renders earlier history) or ``template_mismatch`` (the template's turn cannot be
  split at its end-of-turn text, or ``on_render_mismatch="break"``).

Every check is on text the template rendered; the carried ids are tokenised from that
text alone, so the model always sees its own tokens followed by what the template writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from ...errors import BadRequest

__all__ = [
    "ON_RENDER_MISMATCH",
    "REASONING_MODES",
    "ChildTurn",
    "Formed",
    "Renderer",
    "SpliceRules",
    "form_child",
    "splice_cause",
]

Renderer = Callable[[Sequence[Mapping[str, Any]], bool], str]
"""``render(messages, add_generation_prompt) -> text``: the chat template, bound to a request."""

ON_RENDER_MISMATCH: Final = ("splice", "break")
"""What to do when the template renders a parent's turn differently from its generation."""
REASONING_MODES: Final = ("follow_template", "keep_model_tokens")
"""Reasoning a template drops from history: break with it, or keep the model's tokens."""
_PROBE: Final = "TOKCAPPROBE7f3a"


@dataclass(frozen=True, slots=True)
class SpliceRules:
    """How a child is formed when the template re-renders its parent's turn."""

    markers: Sequence[str] = ("<think>",)
    """Text that opens a reasoning block."""
    special_texts: Sequence[str] = ()
    """The tokenizer's special tokens (the text returned to harnesses omits them)."""
    on_render_mismatch: Literal["splice", "break"] = "splice"
    reasoning: Literal["follow_template", "keep_model_tokens"] = "follow_template"


@dataclass(frozen=True, slots=True)
class Formed:
    """How the child extends its parent: ``carry`` is the text tokenised after its ids."""

    formation: Literal["extend", "splice"] | None
    """None: no way to extend the parent (a break)."""
    carry: str = ""
    break_cause: str | None = None
    splice_cause: str | None = None


def _break(cause: str) -> Formed:
    return Formed(None, break_cause=cause)


def _lost(before: str, after: str, markers: Sequence[str]) -> bool:
    return any(before.count(m) > after.count(m) for m in markers)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildTurn:
    """A new request whose message ``k`` is its parent's turn: what forming the child reads.

    ``prompt_text`` and ``generated`` are the parent's ``T`` and ``G``; ``full`` is the new
    request rendered with its generation prompt.
    """

    messages: Sequence[Mapping[str, Any]]
    k: int
    prompt_text: str
    generated: str
    full: str
    render: Renderer
    rules: SpliceRules


def form_child(child: ChildTurn) -> Formed:
    """Extend, splice or break the child (module doc)."""
    messages, k, render, rules = child.messages, child.k, child.render, child.rules
    prompt_text, generated, full = child.prompt_text, child.generated, child.full
    history = render(messages[: k + 1], False)
    if not history.startswith(prompt_text):
        if _lost(prompt_text + generated, history, rules.markers):
            return _keep_reasoning(child)
        return _break("history_rewritten")
    turn = history[len(prompt_text) :]
    if not full.startswith(history):
        # compare without the generation prompt, which may open a reasoning block itself
        unprompted = render(messages, False)
        start = _common_prefix(history, unprompted)
        if _lost(history[start:], unprompted[start:], rules.markers):
            return _keep_reasoning(child)
        return _break("template_unstable")
    if turn.startswith(generated):
        return Formed("extend", carry=full[len(prompt_text) + len(generated) :])
    close = _close(messages, k, render)
    if close is None or not turn.endswith(close):
        return _break("template_mismatch")
    ended = _ended(generated, close, rules.special_texts)
    core = generated[: len(generated) - len(ended)]
    cause = splice_cause(
        core,
        turn[: len(turn) - len(close)],
        markers=rules.markers,
        special_texts=rules.special_texts,
        tool_calls=bool(messages[k].get("tool_calls")),
    )
    if cause == "reasoning":
        return _keep_reasoning(child)
    if rules.on_render_mismatch == "break":
        return _break("template_mismatch")
    carry = close[len(ended) :] + full[len(history) :]
    return Formed("splice", carry=carry, splice_cause=cause)


def _keep_reasoning(child: ChildTurn) -> Formed:
    """The template drops reasoning from the parent's turn: break, or splice past it.

    The new messages are read off a rendering of the request with a probe in place of
    the parent's turn (so nothing in it is stripped); the history before that turn must
    be what the parent's prompt held, or it is a real history change.
    """
    messages, k, render, rules = child.messages, child.k, child.render, child.rules
    prompt_text, generated, full = child.prompt_text, child.generated, child.full
    if rules.reasoning == "follow_template" or rules.on_render_mismatch == "break":
        return _break("reasoning_stripped")
    try:
        before = render(messages[:k], False)
        probed = render([*messages[:k], _probe_turn(), *messages[k + 1 :]], True)
    except BadRequest:
        return _break("reasoning_stripped")
    at = probed.find(_PROBE)
    close = _close(messages, k, render)
    if (
        at < 0
        or close is None
        or not prompt_text.startswith(before)
        or not full.startswith(before)
        or not probed.startswith(before)
    ):
        return _break("reasoning_stripped")
    tail = probed[at + len(_PROBE) :]
    if not tail.startswith(close) or not full.endswith(tail[len(close) :]):
        return _break("reasoning_stripped")
    ended = _ended(generated, close, rules.special_texts)
    carry = close[len(ended) :] + tail[len(close) :]
    return Formed("splice", carry=carry, splice_cause="reasoning")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _probe_turn() -> dict[str, Any]:
    return {"role": "assistant", "content": _PROBE}


def _close(messages: Sequence[Mapping[str, Any]], k: int, render: Renderer) -> str | None:
    """The text the template writes after an assistant turn's content (e.g. ``<|im_end|>\\n``)."""
    try:
        probed = render([*messages[:k], _probe_turn()], False)
    except BadRequest:
        return None
    at = probed.rfind(_PROBE)
    return None if at < 0 else probed[at + len(_PROBE) :]


def _ended(generated: str, close: str, special_texts: Sequence[str]) -> str:
    """How much of the template's ``close`` the generation already ends with.

    The whole close when the model wrote it itself; else its leading end-of-turn token
    (a special token, e.g. ``<|im_end|>`` of ``<|im_end|>\\n``) when the generation
    stopped on it; else nothing (cut by ``max_tokens`` or a stop string): the child's
    carried text then begins with the template's end of turn.
    """
    if close and generated.endswith(close):
        return close
    eot = max((s for s in special_texts if s and close.startswith(s)), key=len, default="")
    return eot if eot and generated.endswith(eot) else ""


def splice_cause(
    generated: str,
    rendered: str,
    *,
    markers: Sequence[str],
    special_texts: Sequence[str],
    tool_calls: bool,
) -> str:
    """Why the template's rendering of a turn (``rendered``) differs from ``generated``.

    Both are the turn's content, end-of-turn text excluded. In order: ``reasoning`` (a
    marker the rendering lost), ``special_tokens`` (removing special tokens from the
    generation gives the rendering), ``invalid_utf8`` (the generation decodes to U+FFFD),
    ``tool_call_format`` (the turn carries tool calls, which the template re-serialised),
    ``whitespace`` (equal but for whitespace and special tokens), else ``other``.
    """
    if _lost(generated, rendered, markers):
        return "reasoning"
    stripped = generated
    for text in sorted((s for s in special_texts if s), key=len, reverse=True):
        stripped = stripped.replace(text, "")
    if stripped != generated and stripped == rendered:
        return "special_tokens"
    if "\ufffd" in generated:
        return "invalid_utf8"
    if tool_calls:
        return "tool_call_format"
    if "".join(stripped.split()) == "".join(rendered.split()):
        return "whitespace"
    return "other"
