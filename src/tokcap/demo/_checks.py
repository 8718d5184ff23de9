"""The demo's two checks on the reassembled rows.

- **Engine parity** (independent of the gate): every call of every valid row must equal
  what the engine reported to the harness for that call (``return_token_ids``): the row
  up to the end of the call is exactly that call's ``prompt_token_ids + token_ids``, and
  its logprobs are the ones the server returned. The call is matched through the
  manifest's ``Staged.response_id``. The Responses and Messages APIs return no ids: for
  their calls the row's prompt and generated lengths must be the ones vLLM reported
  (``usage``), and the logprobs the ones returned where the API returns them (a Responses
  turn answered in text).
- **Re-tokenisation drift** (what tokcap avoids): render the harness's final transcript
  through the chat template (or the family's tokenizer, `tokcap.demo._families`), as a trainer
  that re-tokenises text would, and compare with the row. Template text after the row's
  last token (ChatML's ``\\n`` after ``<|im_end|>``) is not counted as drift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokcap_core import Manifest, TrainingRow
from tokcap_core.ledger import Staged

from ._harness import EngineCall, Episode

__all__ = ["Drift", "Parity", "check_rows", "engine_parity", "retokenization_drift"]


@dataclass(frozen=True, slots=True)
class Parity:
    """One row against the engine's own reports."""

    rollout_id: str
    segment: int
    calls_checked: int
    differs_at: int | None
    """First token position where the row and the engine disagree (None: identical)."""
    max_logprob_diff: float


@dataclass(frozen=True, slots=True)
class Drift:
    """One trajectory re-tokenised from text."""

    rollout_id: str
    row_len: int
    retok_len: int
    first_diff: int | None
    """First position where re-tokenised ids differ from the row (None: no drift)."""
    retok_ids: list[int]


def _response_ids(manifest: Manifest) -> dict[str, str | None]:
    return {
        e.event.call_id: e.event.response_id
        for e in manifest.entries
        if isinstance(e.event, Staged)
    }


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def engine_parity(row: TrainingRow, manifest: Manifest, calls: Sequence[EngineCall]) -> Parity:
    """Compare a valid row with the engine's per-call reports (see module docstring)."""
    by_response = {c.response_id: c for c in calls}
    response_of = _response_ids(manifest)
    ids = list(row.input_ids)
    differs: int | None = None
    worst = 0.0
    for span in row.call_spans:
        call = by_response.get(response_of.get(span.call_id) or "")
        end = span.start + span.carry_len + span.gen_len
        if call is None:
            differs = span.start if differs is None else differs
            continue
        if call.usage is not None:
            lengths = (end - span.gen_len, span.gen_len)
            at = None if lengths == call.usage else span.start
        else:
            at = _first_diff(ids[:end], call.prompt_token_ids + call.token_ids)
        if at is not None and (differs is None or at < differs):
            differs = at
        gen_start = end - span.gen_len
        for got, want in zip(row.logprobs[gen_start:end], call.logprobs, strict=False):
            if math.isfinite(want):
                worst = max(worst, abs(got - want))
    return Parity(row.rollout_id, row.segment, len(row.call_spans), differs, worst)


Retokenize = Callable[[Any, Sequence[dict[str, Any]]], list[int]]
"""``(tokenizer, messages)`` → the ids a text-based trainer would train on."""


def retokenization_drift(
    row: TrainingRow, episode: Episode, tokenizer: Any, retokenize: Retokenize
) -> Drift:
    """Re-tokenise ``episode``'s final transcript (``retokenize``); compare to ``row``."""
    retok = retokenize(tokenizer, episode.messages)
    ids = list(row.input_ids)
    at = _first_diff(ids, retok[: len(ids)])
    return Drift(row.rollout_id, len(ids), len(retok), at, retok)


def check_rows(
    rows: Sequence[TrainingRow],
    episodes: Mapping[str, Episode],
    manifests: Mapping[str, Manifest],
    tokenizer: Any,
    retokenize: Retokenize,
) -> tuple[list[Parity], list[Drift]]:
    """Engine parity for every valid row; drift for every valid terminal (segment 0) row."""
    parity = [
        engine_parity(r, manifests[r.rollout_id], episodes[r.rollout_id].calls)
        for r in rows
        if r.sample_mask
    ]
    drift = [
        retokenization_drift(r, episodes[r.rollout_id], tokenizer, retokenize)
        for r in rows
        if r.sample_mask and r.segment == 0
    ]
    return parity, drift
