"""Logprob parity, importance weights, sequence ratio masks: laws, then worked examples."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import placeholder_row
from tokcap_core.parity import (
    LogprobParity,
    ParityInputError,
    logprob_parity,
    sequence_ratio_mask,
    truncated_importance_weights,
)

CAP = 2.0
BAND = {"low": 0.5, "high": 2.0}


@dataclass(frozen=True)
class Rows:
    engine_N: list[list[float]]
    trainer_N: list[list[float]]
    mask_N: list[list[int]]
    valid_N: list[int]


logprobs = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)
garbage = st.one_of(st.floats(allow_nan=True, allow_infinity=True), logprobs)


@st.composite
def rows(draw: st.DrawFn, *, max_rows: int = 6, max_len: int = 10) -> Rows:
    """Rows of engine/trainer logprobs, a loss mask and per-row validity."""
    engine_N, trainer_N, mask_N, valid_N = [], [], [], []
    for _ in range(draw(st.integers(0, max_rows))):
        n = draw(st.integers(0, max_len))
        engine = draw(st.lists(logprobs, min_size=n, max_size=n))
        noise = draw(st.lists(st.floats(-3.0, 3.0), min_size=n, max_size=n))
        engine_N.append(engine)
        trainer_N.append([e + x for e, x in zip(engine, noise, strict=True)])
        mask_N.append(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        valid_N.append(draw(st.integers(0, 1)))
    return Rows(engine_N, trainer_N, mask_N, valid_N)


def parity(r: Rows) -> LogprobParity:
    return logprob_parity(r.engine_N, r.trainer_N, r.mask_N, valid_N=r.valid_N)


def weights(r: Rows) -> list[list[float]]:
    return truncated_importance_weights(
        r.engine_N, r.trainer_N, r.mask_N, cap=CAP, valid_N=r.valid_N
    )


def kept(r: Rows, aggregate: str = "geometric") -> list[int]:
    return sequence_ratio_mask(
        r.engine_N, r.trainer_N, r.mask_N, valid_N=r.valid_N, aggregate=aggregate, **BAND
    )  # type: ignore[arg-type]


def bits(p: LogprobParity) -> tuple[int, str, str, str]:
    return p.tokens, p.mean_abs.hex(), p.max_abs.hex(), p.k3.hex()


def weight_bits(w: list[list[float]]) -> list[list[str]]:
    return [[x.hex() for x in row] for row in w]


def counted(r: Rows) -> int:
    return sum(sum(m) for m, v in zip(r.mask_N, r.valid_N, strict=True) if v)


# ---- laws ----------------------------------------------------------------------------------


@given(rows())
def test_identical_inputs_give_zero_parity_unit_weights_and_keep_every_valid_row(r: Rows) -> None:
    same = replace(r, trainer_N=r.engine_N)
    assert parity(same) == LogprobParity(tokens=counted(r), mean_abs=0.0, max_abs=0.0, k3=0.0)
    assert weights(same) == [
        [1.0 if m and v else 0.0 for m in mask] for mask, v in zip(r.mask_N, r.valid_N, strict=True)
    ]
    assert kept(same) == r.valid_N
    assert kept(same, "product") == r.valid_N


@given(rows(), st.data())
def test_values_under_mask_zero_or_in_invalid_rows_change_nothing(
    r: Rows, data: st.DataObject
) -> None:
    def scramble(values_N: list[list[float]]) -> list[list[float]]:
        return [
            [x if m and v else data.draw(garbage) for x, m in zip(values, mask, strict=True)]
            for values, mask, v in zip(values_N, r.mask_N, r.valid_N, strict=True)
        ]

    noisy = replace(r, engine_N=scramble(r.engine_N), trainer_N=scramble(r.trainer_N))
    assert bits(parity(noisy)) == bits(parity(r))
    assert weight_bits(weights(noisy)) == weight_bits(weights(r))
    assert kept(noisy) == kept(r)
    assert kept(noisy, "product") == kept(r, "product")


@given(rows())
def test_k3_is_never_negative_and_the_figures_are_consistent(r: Rows) -> None:
    p = parity(r)
    assert p.k3 >= 0
    assert p.tokens == counted(r)
    assert 0 <= p.mean_abs <= p.max_abs
    if p.tokens == 0:
        assert p == LogprobParity(tokens=0, mean_abs=0.0, max_abs=0.0, k3=0.0)


@given(rows(), st.randoms(use_true_random=False))
def test_row_order_does_not_matter(r: Rows, rng: object) -> None:
    order = list(range(len(r.engine_N)))
    rng.shuffle(order)  # type: ignore[attr-defined]
    shuffled = Rows(*([column[i] for i in order] for column in vars(r).values()))
    assert bits(parity(shuffled)) == bits(parity(r))
    assert weight_bits(weights(shuffled)) == [weight_bits(weights(r))[i] for i in order]
    assert kept(shuffled) == [kept(r)[i] for i in order]


@given(rows(), st.integers(1, 4))
def test_placeholder_rows_contribute_nothing(r: Rows, how_many: int) -> None:
    placeholder = placeholder_row("rollout-x", "stage_failed:boom")
    padded = Rows(
        r.engine_N + [list(placeholder.logprobs)] * how_many,
        r.trainer_N + [[float("nan")]] * how_many,  # whatever a trainer computed there
        r.mask_N + [list(placeholder.loss_mask)] * how_many,
        r.valid_N + [placeholder.sample_mask] * how_many,
    )
    assert bits(parity(padded)) == bits(parity(r))
    assert weights(padded)[len(r.engine_N) :] == [[0.0]] * how_many
    assert kept(padded) == kept(r) + [0] * how_many


def vectorised(r: Rows) -> tuple[LogprobParity, list[float], list[int]]:
    """The same figures the way a tensor library computes them: flat columns, select, reduce."""
    flat_d = [t - e for row_e, row_t in zip(r.engine_N, r.trainer_N, strict=True)
              for e, t in zip(row_e, row_t, strict=True)]  # fmt: skip
    flat_keep = [m * v for mask, v in zip(r.mask_N, r.valid_N, strict=True) for m in mask]
    selected = [d for d, keep in zip(flat_d, flat_keep, strict=True) if keep]
    n = len(selected)
    figures = LogprobParity(
        tokens=n,
        mean_abs=math.fsum(map(abs, selected)) / n if n else 0.0,
        max_abs=max(map(abs, selected), default=0.0),
        k3=math.fsum(math.expm1(d) - d for d in selected) / n if n else 0.0,
    )
    flat_w = [
        min(math.exp(d), CAP) if keep else 0.0 for d, keep in zip(flat_d, flat_keep, strict=True)
    ]
    row_of = [i for i, mask in enumerate(r.mask_N) for _ in mask]
    sums = [
        math.fsum(
            d for d, keep, row in zip(flat_d, flat_keep, row_of, strict=True) if keep and row == i
        )
        for i in range(len(r.mask_N))
    ]
    counts = [sum(mask) for mask in r.mask_N]
    means = [s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)]
    mask = [
        int(v and math.log(BAND["low"]) <= s <= math.log(BAND["high"]))
        for s, v in zip(means, r.valid_N, strict=True)
    ]
    return figures, flat_w, mask


@given(rows())
def test_a_loop_and_a_vectorised_version_agree_bit_for_bit(r: Rows) -> None:
    figures, flat_w, mask = vectorised(r)
    assert bits(parity(r)) == bits(figures)
    assert [w.hex() for row in weights(r) for w in row] == [w.hex() for w in flat_w]
    assert kept(r) == mask


@given(rows())
def test_truncated_weights_are_exp_of_the_log_ratio_capped(r: Rows) -> None:
    for e_row, t_row, m_row, v, w_row in zip(
        r.engine_N, r.trainer_N, r.mask_N, r.valid_N, weights(r), strict=True
    ):
        for e, t, m, w in zip(e_row, t_row, m_row, w_row, strict=True):
            assert w == (min(math.exp(t - e), CAP) if m and v else 0.0)
            assert 0 <= w <= CAP


# ---- worked examples and edges -------------------------------------------------------------


def test_worked_example() -> None:
    engine = [[0.0, math.log(0.5), math.log(0.25), -1.0]]
    trainer = [[-5.0, math.log(0.25), math.log(0.75), -1.0]]  # first token is the prompt
    mask = [[0, 1, 1, 1]]
    d = [math.log(0.5), math.log(3.0), 0.0]
    p = logprob_parity(engine, trainer, mask)
    assert p.tokens == 3
    assert p.mean_abs == pytest.approx((math.log(2) + math.log(3)) / 3)
    assert p.max_abs == pytest.approx(math.log(3))
    assert p.k3 == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert truncated_importance_weights(engine, trainer, mask, cap=2.0) == [
        [0.0, pytest.approx(0.5), 2.0, 1.0]
    ]
    # geometric mean ratio: exp(log(1.5) / 3) ~ 1.14; product: 1.5
    assert sequence_ratio_mask(engine, trainer, mask, low=0.9, high=1.2) == [1]
    assert sequence_ratio_mask(engine, trainer, mask, low=0.9, high=1.2, aggregate="product") == [0]
    assert sequence_ratio_mask(
        engine, trainer, mask, low=0.9, high=math.inf, aggregate="product"
    ) == [1]


def test_empty_input_all_masked_and_no_valid_row_count_nothing() -> None:
    zero = LogprobParity(tokens=0, mean_abs=0.0, max_abs=0.0, k3=0.0)
    assert logprob_parity([], [], []) == zero
    assert logprob_parity([[-1.0, -2.0]], [[-3.0, -4.0]], [[0, 0]]) == zero
    assert logprob_parity([[-1.0]], [[-3.0]], [[1]], valid_N=[0]) == zero
    assert truncated_importance_weights([], [], [], cap=2.0) == []
    assert sequence_ratio_mask([], [], [], low=0.5, high=2.0) == []


def test_a_valid_row_without_loss_tokens_has_ratio_one() -> None:
    assert sequence_ratio_mask([[-1.0]], [[-9.0]], [[0]], low=0.5, high=2.0) == [1]


def test_an_overflowing_ratio_gives_infinite_k3_and_the_cap() -> None:
    p = logprob_parity([[-1000.0]], [[0.0]], [[1]])
    assert p.k3 == math.inf
    assert truncated_importance_weights([[-1000.0]], [[0.0]], [[1]], cap=3.0) == [[3.0]]
    assert sequence_ratio_mask([[-1000.0]], [[0.0]], [[1]], low=0.0, high=math.inf) == [1]


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda: logprob_parity([[0.0]], [], [[1]]), "length_mismatch"),
        (lambda: logprob_parity([[0.0]], [[0.0]], [[1]], valid_N=[1, 1]), "length_mismatch"),
        (lambda: logprob_parity([[0.0, 0.0]], [[0.0]], [[1, 1]]), "ragged_row"),
        (lambda: logprob_parity([[0.0]], [[0.0]], [[1, 0]]), "ragged_row"),
        (lambda: logprob_parity([[0.0]], [[0.0]], [[2]]), "bad_mask_flag"),
        (lambda: logprob_parity([[0.0]], [[0.0]], [[1]], valid_N=[7]), "bad_valid_flag"),
        (lambda: logprob_parity([[math.nan]], [[0.0]], [[1]]), "non_finite_logprob"),
        (lambda: logprob_parity([[0.0]], [[-math.inf]], [[1]]), "non_finite_logprob"),
        (lambda: truncated_importance_weights([[0.0]], [[0.0]], [[1]], cap=0.5), "bad_cap"),
        (lambda: truncated_importance_weights([[0.0]], [[0.0]], [[1]], cap=math.inf), "bad_cap"),
        (lambda: truncated_importance_weights([[0.0]], [[0.0]], [[1]], cap=math.nan), "bad_cap"),
        (lambda: sequence_ratio_mask([[0.0]], [[0.0]], [[1]], low=1.5, high=2.0), "bad_band"),
        (lambda: sequence_ratio_mask([[0.0]], [[0.0]], [[1]], low=0.5, high=0.9), "bad_band"),
        (lambda: sequence_ratio_mask([[0.0]], [[0.0]], [[1]], low=-1.0, high=2.0), "bad_band"),
        (lambda: sequence_ratio_mask([[0.0]], [[0.0]], [[1]], low=math.nan, high=2.0), "bad_band"),
        (
            lambda: sequence_ratio_mask(
                [[0.0]],
                [[0.0]],
                [[1]],
                low=0.5,
                high=2.0,
                aggregate="mean",  # type: ignore[arg-type]
            ),
            "bad_aggregate",
        ),
    ],
)
def test_bad_input_is_refused_with_a_stable_code(call: object, code: str) -> None:
    with pytest.raises(ParityInputError) as info:
        call()  # type: ignore[operator]
    assert info.value.code == code
    assert isinstance(info.value, ValueError)


def test_training_row_buffers_are_accepted_as_they_are() -> None:
    from array import array

    engine = [array("f", [0.0, -0.5, -1.25])]
    mask = [array("B", [0, 1, 1])]
    p = logprob_parity(engine, [[0.0, -0.5, -1.25]], mask)
    assert p == LogprobParity(tokens=2, mean_abs=0.0, max_abs=0.0, k3=0.0)
