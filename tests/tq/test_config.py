"""`TQSinkConfig` refuses configurations a sink cannot honour (no cluster needed)."""

from __future__ import annotations

import math

import pytest

from tokcap_core import SinkError
from tokcap_tq import TQSinkConfig


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, True])
def test_operation_deadline_must_be_a_positive_finite_number(timeout: float) -> None:
    with pytest.raises(SinkError) as info:
        TQSinkConfig(op_timeout_s=timeout)
    assert info.value.code == "bad_config"


@pytest.mark.parametrize("name", ["", "a/b"])
def test_partition_names_are_non_empty_and_slash_free(name: str) -> None:
    with pytest.raises(SinkError) as info:
        TQSinkConfig(staging_partition=name)
    assert info.value.code == "bad_config"


def test_staging_and_training_partitions_differ() -> None:
    with pytest.raises(SinkError) as info:
        TQSinkConfig(staging_partition="same", training_partition="same")
    assert info.value.code == "bad_config"


def test_defaults_give_every_operation_a_deadline() -> None:
    assert TQSinkConfig().op_timeout_s == 60.0
