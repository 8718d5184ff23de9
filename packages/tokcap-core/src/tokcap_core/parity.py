"""Engine-vs-trainer logprob parity and importance corrections (pure, stdlib only).

Every function takes rows of per-token logprobs: ``engine_N`` (what the engine
reported when it sampled), ``trainer_N`` (what the trainer recomputes on the same
ids) and ``mask_N`` (the loss mask: 1 on the generated tokens the loss sees), plus
an optional per-row ``valid_N`` (a row's ``sample_mask``; default: every row valid).
Per token ``d = trainer - engine``: the log of the trainer-over-engine probability
ratio. Laws shared by every function:

- only tokens with mask 1 in valid rows are read; whatever sits under mask 0 or in
  an invalid row (a placeholder, NaN, garbage) changes nothing, bit for bit;
- identical engine and trainer values give ``d == 0`` everywhere: parity 0, weights
  1, every valid row kept;
- permuting rows permutes per-row output and leaves aggregates bit-for-bit equal
  (every sum is a ``math.fsum``, exact hence order-independent).

Shape is structure, checked on every row: the three sequences of a row have one
length. Values are checked where read: a non-finite logprob on a masked-in token of
a valid row is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from ._errors import TokcapError

__all__ = [
    "LogprobParity",
    "ParityInputError",
    "logprob_parity",
    "sequence_ratio_mask",
    "truncated_importance_weights",
]

Rows = Sequence[Sequence[float]]
MaskRows = Sequence[Sequence[int]]


class ParityInputError(TokcapError, ValueError):
    """Bad parity input: ragged rows, a bad flag, a non-finite value, a bad parameter."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobParity:
    """How far the trainer's logprobs are from the engine's over the counted tokens.

    ``tokens`` counted, ``mean_abs`` and ``max_abs`` of ``|d|``, and ``k3`` the mean of
    ``exp(d) - 1 - d`` (Schulman's k3 estimator of KL(engine || trainer): >= 0, ~ d²/2
    for small d). All 0.0 when no token counts; ``k3`` is ``inf`` if some ``exp(d)``
    overflows.
    """

    tokens: int
    mean_abs: float
    max_abs: float
    k3: float


def _log_ratios(
    engine_N: Rows, trainer_N: Rows, mask_N: MaskRows, valid_N: Sequence[int] | None
) -> Iterator[list[float] | None]:
    """Check the rows and yield, per row, ``d`` at its masked-in tokens (None: invalid row)."""
    columns = [trainer_N, mask_N] + ([] if valid_N is None else [valid_N])
    if any(len(column) != len(engine_N) for column in columns):
        lengths = [len(engine_N)] + [len(column) for column in columns]
        raise ParityInputError("length_mismatch", f"per-row sequences differ in length: {lengths}")
    for row in range(len(engine_N)):
        engine, trainer, mask = engine_N[row], trainer_N[row], mask_N[row]
        if not len(engine) == len(trainer) == len(mask):
            raise ParityInputError(
                "ragged_row",
                f"row {row}: {len(engine)} engine, {len(trainer)} trainer, {len(mask)} mask values",
            )
        if any(flag not in (0, 1) for flag in mask):
            raise ParityInputError("bad_mask_flag", f"row {row}: mask values must be 0/1")
        flag = 1 if valid_N is None else valid_N[row]
        if flag not in (0, 1):
            raise ParityInputError("bad_valid_flag", f"row {row}: valid flag {flag!r} is not 0/1")
        if not flag:
            yield None
            continue
        ratios: list[float] = []
        for e, t, m in zip(engine, trainer, mask, strict=True):
            if m:
                if not (math.isfinite(e) and math.isfinite(t)):
                    raise ParityInputError(
                        "non_finite_logprob", f"row {row}: engine {e!r}, trainer {t!r}"
                    )
                ratios.append(float(t) - float(e))
        yield ratios


def _k3_term(d: float) -> float:
    """``exp(d) - 1 - d`` as ``expm1(d) - d``: exact near 0 and never negative."""
    try:
        return math.expm1(d) - d
    except OverflowError:
        return math.inf


def _exp(d: float) -> float:
    try:
        return math.exp(d)
    except OverflowError:
        return math.inf


def logprob_parity(
    engine_N: Rows,
    trainer_N: Rows,
    mask_N: MaskRows,
    *,
    valid_N: Sequence[int] | None = None,
) -> LogprobParity:
    """Parity of ``trainer_N`` against ``engine_N`` over masked-in tokens of valid rows.

    Empty input, an all-zero mask or no valid row give ``LogprobParity(tokens=0, ...)``
    with every figure 0.0. Raises `ParityInputError` with ``length_mismatch``,
    ``ragged_row``, ``bad_mask_flag``, ``bad_valid_flag`` or ``non_finite_logprob``.
    """
    ratios = [d for row in _log_ratios(engine_N, trainer_N, mask_N, valid_N) for d in row or ()]
    if not ratios:
        return LogprobParity(tokens=0, mean_abs=0.0, max_abs=0.0, k3=0.0)
    n = len(ratios)
    magnitudes = [abs(d) for d in ratios]
    return LogprobParity(
        tokens=n,
        mean_abs=math.fsum(magnitudes) / n,
        max_abs=max(magnitudes),
        k3=math.fsum(_k3_term(d) for d in ratios) / n,
    )


def truncated_importance_weights(
    engine_N: Rows,
    trainer_N: Rows,
    mask_N: MaskRows,
    *,
    cap: float,
    valid_N: Sequence[int] | None = None,
) -> list[list[float]]:
    """TIS: per token ``min(exp(d), cap)``, one list per row, shaped like ``mask_N``.

    ``d`` is the trainer's *pre-update* logprob minus the engine's, so the weight
    corrects for the engine sampling from a slightly different policy than the one
    being trained. Tokens under mask 0 and every token of an invalid row get ``0.0``:
    the weights double as the loss mask, so multiplying a per-token loss by them can
    never let a masked token in. ``cap`` must be finite and >= 1 (identical inputs give
    exactly 1.0); raises `ParityInputError` (``bad_cap`` or the input codes of
    `logprob_parity`).
    """
    if not (math.isfinite(cap) and cap >= 1):
        raise ParityInputError("bad_cap", f"cap must be finite and >= 1, got {cap!r}")
    weights_N: list[list[float]] = []
    for mask, ratios in zip(mask_N, _log_ratios(engine_N, trainer_N, mask_N, valid_N), strict=True):
        if ratios is None:
            weights_N.append([0.0] * len(mask))
            continue
        computed = iter(ratios)
        weights_N.append([min(_exp(next(computed)), cap) if m else 0.0 for m in mask])
    return weights_N


def sequence_ratio_mask(
    engine_N: Rows,
    trainer_N: Rows,
    mask_N: MaskRows,
    *,
    low: float,
    high: float,
    valid_N: Sequence[int] | None = None,
    aggregate: Literal["geometric", "product"] = "geometric",
) -> list[int]:
    """MIS-style sequence mask: 1 for a valid row whose sequence ratio lies in ``[low, high]``.

    The sequence ratio is the per-token geometric mean ``exp(mean(d))`` (default:
    comparable across lengths) or the product ``exp(sum(d))`` (the true sequence
    likelihood ratio, which drifts with length). It is compared in log space,
    ``log(low) <= s <= log(high)``, so nothing overflows. A valid row with no masked-in
    token has ratio 1. Invalid rows get 0. Needs ``0 <= low <= 1 <= high`` (``high``
    may be ``inf``); raises `ParityInputError` (``bad_band``, ``bad_aggregate`` or the
    input codes of `logprob_parity`).
    """
    if not (0 <= low <= 1 <= high) or math.isnan(low) or math.isnan(high):
        raise ParityInputError("bad_band", f"need 0 <= low <= 1 <= high, got {low!r}, {high!r}")
    if aggregate not in ("geometric", "product"):
        raise ParityInputError(
            "bad_aggregate", f"aggregate is 'geometric' or 'product': {aggregate!r}"
        )
    log_low = -math.inf if low == 0 else math.log(low)
    log_high = math.log(high)
    kept_N: list[int] = []
    for ratios in _log_ratios(engine_N, trainer_N, mask_N, valid_N):
        if ratios is None:
            kept_N.append(0)
            continue
        total = math.fsum(ratios)
        s = total / len(ratios) if aggregate == "geometric" and ratios else total
        kept_N.append(1 if log_low <= s <= log_high else 0)
    return kept_N
