"""`TQSinkConfig` refuses configurations a sink cannot honour (no cluster needed)."""

from __future__ import annotations

import math

import pytest

from tokcap_core import ConfigError
from tokcap_tq import TQSinkConfig


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, True, "5"])
def test_operation_deadline_must_be_a_positive_finite_number(timeout: object) -> None:
    with pytest.raises(ConfigError) as info:
        TQSinkConfig(op_timeout_s=timeout)  # type: ignore[arg-type]
    assert info.value.code == "bad_op_timeout_s"


@pytest.mark.parametrize("field", ["staging_partition", "training_partition", "media_partition"])
@pytest.mark.parametrize("name", ["", "a/b", None, 3])
def test_partition_names_are_non_empty_and_slash_free(field: str, name: object) -> None:
    with pytest.raises(ConfigError) as info:
        TQSinkConfig(**{field: name})  # type: ignore[arg-type]
    assert info.value.code == f"bad_{field}"


def test_staging_and_training_partitions_differ() -> None:
    with pytest.raises(ConfigError) as info:
        TQSinkConfig(staging_partition="same", training_partition="same")
    assert info.value.code == "bad_training_partition"


@pytest.mark.parametrize("other", ["staging_partition", "training_partition"])
def test_the_media_partition_is_a_partition_of_its_own(other: str) -> None:
    with pytest.raises(ConfigError) as info:
        TQSinkConfig(**{other: "same", "media_partition": "same"})  # type: ignore[arg-type]
    assert info.value.code == "bad_media_partition"


def test_defaults_give_every_operation_a_deadline() -> None:
    config = TQSinkConfig()
    assert config.op_timeout_s == 60.0
    assert config.staging_partition != config.training_partition


def test_the_old_buffer_name_still_resolves_with_a_deprecation_warning() -> None:
    import tokcap_tq

    with pytest.warns(DeprecationWarning, match="use TQGroupBuffer"):
        assert tokcap_tq.TQReplayBuffer is tokcap_tq.TQGroupBuffer  # type: ignore[attr-defined]
