"""`connect_tq`, `local_cluster` and `local_tq` refuse bad arguments before touching Ray
(`ConfigError` ``bad_<argument>``, as every config does; no cluster needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokcap_core import ConfigError
from tokcap_tq import NodeSpec, connect_tq, local_cluster, local_tq


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"address": ""}, "bad_address"),
        ({"storage_units": 0}, "bad_storage_units"),
        ({"storage_units": True}, "bad_storage_units"),
        ({"storage_resource": ""}, "bad_storage_resource"),
        ({"init_timeout_s": 0}, "bad_init_timeout_s"),
    ],
)
def test_connect_tq_checks_its_arguments_first(kwargs: dict[str, Any], code: str) -> None:
    arguments = {"address": "127.0.0.1:6379"} | kwargs
    with pytest.raises(ConfigError) as info, connect_tq(**arguments):
        pass
    assert info.value.code == code


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"storage_units": 0}, "bad_storage_units"),
        ({"extra_cpus": -1}, "bad_extra_cpus"),
        ({"init_timeout_s": -1.0}, "bad_init_timeout_s"),
    ],
)
def test_local_tq_checks_its_arguments_first(
    tmp_path: Path, kwargs: dict[str, Any], code: str
) -> None:
    with pytest.raises(ConfigError) as info, local_tq(tmp_path, **kwargs):
        pass
    assert info.value.code == code


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"num_cpus": -1}, "bad_num_cpus"),
        ({"num_cpus": 1.5}, "bad_num_cpus"),
        ({"resources": {"CPU": 1}}, "bad_resources"),
        ({"resources": {"": 1}}, "bad_resources"),
        ({"resources": {"tq_storage": 0}}, "bad_resources"),
    ],
)
def test_node_specs_hold_whole_cpus_and_positive_custom_resources(
    kwargs: dict[str, Any], code: str
) -> None:
    with pytest.raises(ConfigError) as info:
        NodeSpec(**kwargs)
    assert info.value.code == code


def test_a_cluster_needs_a_head(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info, local_cluster(tmp_path, []):
        pass
    assert info.value.code == "bad_nodes"
