"""`PoolConfig` validation and `step_metrics` aggregation (no Ray cluster needed)."""

from __future__ import annotations

import pytest

from tokcap_core import ConfigError
from tokcap_ray import PoolConfig, step_metrics


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_workers", 0),
        ("num_workers", True),
        ("num_cpus", 0),
        ("num_cpus", -0.5),
        ("num_cpus", float("inf")),
        ("num_cpus", "1"),
        ("max_in_flight", 0),
        ("actor_concurrency", 1.5),
        ("max_retries", -1),
        ("scheduling_strategy", None),
    ],
)
def test_bad_settings_raise_config_error_naming_the_field(field: str, value: object) -> None:
    settings: dict[str, object] = {"num_workers": 2, field: value}
    with pytest.raises(ConfigError) as info:
        PoolConfig(**settings)  # type: ignore[arg-type]
    assert info.value.code == f"bad_{field}"


def test_defaults_spread_actors_with_one_cpu_each() -> None:
    config = PoolConfig(num_workers=2)
    assert (config.num_cpus, config.scheduling_strategy, config.max_retries) == (1.0, "SPREAD", 2)


def test_step_metrics_of_no_groups_is_all_zero() -> None:
    metrics = step_metrics([])
    assert metrics["groups/total"] == 0.0
    assert metrics["rows/valid_fraction"] == 0.0
    assert all(v == 0.0 for v in metrics.values())
