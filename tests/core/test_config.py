"""CaptureConfig: unsupported combinations raise, risky ones warn, the token never prints."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import ConfigError
from tokcap_core.config import CaptureConfig
from tokcap_core.receipts import SEGMENT_MODES

SECRET = "s3cr3t-token-value-XYZ"


def codes_of(**kwargs: Any) -> str:
    with pytest.raises(ConfigError) as e:
        CaptureConfig(**kwargs)
    return e.value.code


def test_the_default_config_is_valid_and_warns_only_about_terminal_segments() -> None:
    warnings = CaptureConfig().validate()
    assert len(warnings) == 1
    assert "terminal" in warnings[0]
    assert "not trained" in warnings[0]


def test_all_segments_mode_has_no_warning() -> None:
    assert CaptureConfig(segments="all").validate() == []


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"capture_routes": True, "model_is_moe": False}, "routes_without_moe"),
        ({"segments": "every"}, "bad_segments"),
        ({"min_valid_fraction": -0.1}, "bad_min_valid_fraction"),
        ({"min_valid_fraction": 1.5}, "bad_min_valid_fraction"),
        ({"min_valid_fraction": float("nan")}, "bad_min_valid_fraction"),
        ({"max_seq_len": 0}, "bad_max_seq_len"),
        ({"max_seq_len": 8.0}, "bad_max_seq_len"),
        ({"num_experts": 0}, "bad_num_experts"),
        ({"num_experts": 2**31 + 1}, "bad_num_experts"),
        ({"control_token": "a", "control_token_env": "TOKCAP_TOKEN"}, "ambiguous_token"),
        ({"stage_timeout_s": 0}, "bad_timeout"),
        ({"stage_timeout_s": -1.0}, "bad_timeout"),
        ({"stage_timeout_s": float("inf")}, "bad_timeout"),
        ({"stage_timeout_s": float("nan")}, "bad_timeout"),
        ({"capture_routes": 1}, "bad_type"),
        ({"model_is_moe": "yes"}, "bad_type"),
        ({"control_token": ""}, "bad_token"),
        ({"control_token_env": ""}, "bad_token_env"),
    ],
)
def test_an_unsupported_combination_raises_its_code(kwargs: dict[str, Any], code: str) -> None:
    assert codes_of(**kwargs) == code


def test_validate_rechecks_what_the_constructor_checks() -> None:
    config = CaptureConfig()
    object.__setattr__(config, "max_seq_len", 0)  # bypass the constructor on purpose
    with pytest.raises(ConfigError) as e:
        config.validate()
    assert e.value.code == "bad_max_seq_len"


def test_replace_goes_through_the_same_checks() -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(CaptureConfig(), segments="nope")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capture_routes": True, "model_is_moe": None}, "cannot check the model is MoE"),
        ({"return_token_ids": True}, "reach the harness"),
        ({"min_valid_fraction": 0.0}, "min_valid_fraction=0"),
        ({"capture_routes": True, "model_is_moe": True, "num_experts": 40000}, "int32"),
    ],
)
def test_a_risky_choice_warns(kwargs: dict[str, Any], needle: str) -> None:
    warnings = CaptureConfig(segments="all", **kwargs).validate()
    assert len(warnings) == 1
    assert needle in warnings[0]


@pytest.mark.parametrize("experts", [1, 128, 32768])
def test_experts_that_fit_int16_do_not_warn(experts: int) -> None:
    config = CaptureConfig(
        segments="all", capture_routes=True, model_is_moe=True, num_experts=experts
    )
    assert config.validate() == []


def test_many_experts_without_route_capture_do_not_warn() -> None:
    assert CaptureConfig(segments="all", num_experts=40000).validate() == []


def test_every_segment_mode_is_accepted() -> None:
    for mode in SEGMENT_MODES:
        CaptureConfig(segments=mode)


def secret_free(config: CaptureConfig, secret: str) -> None:
    assert secret not in repr(config)
    assert secret not in str(config)
    assert secret not in repr(config.summary())
    assert all(secret not in w for w in config.validate())


def test_the_token_is_never_printed() -> None:
    config = CaptureConfig(control_token=SECRET, return_token_ids=True)
    secret_free(config, SECRET)
    assert config.summary()["control_token"] == "<redacted>"
    assert "control_token" in repr(config)
    assert config.control_token == SECRET


@given(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=24))
def test_no_token_text_reaches_repr_str_summary_or_warnings(token: str) -> None:
    config = CaptureConfig(control_token=token).with_derived(environ={})
    secret_free(config, token)


def test_a_missing_token_is_shown_as_none() -> None:
    assert CaptureConfig().summary()["control_token"] is None


def test_the_config_is_picklable_with_its_token() -> None:
    config = CaptureConfig(control_token=SECRET)
    assert pickle.loads(pickle.dumps(config)) == config


def test_with_derived_takes_the_token_from_the_named_env_var() -> None:
    config = CaptureConfig(control_token_env="TOKCAP_TOKEN")
    derived = config.with_derived(
        environ={"TOKCAP_TOKEN": SECRET},
        token_factory=lambda: pytest.fail("the factory must not be called"),
    )
    assert derived.control_token == SECRET
    assert derived.control_token_env is None
    assert config.control_token is None  # the original is untouched
    secret_free(derived, SECRET)


@pytest.mark.parametrize("environ", [{}, {"TOKCAP_TOKEN": ""}])
def test_a_named_env_var_that_is_missing_or_empty_is_an_error(environ: dict[str, str]) -> None:
    config = CaptureConfig(control_token_env="TOKCAP_TOKEN")
    with pytest.raises(ConfigError) as e:
        config.with_derived(environ=environ)
    assert e.value.code == "token_env_missing"
    assert "TOKCAP_TOKEN" in str(e.value)


def test_with_derived_mints_a_token_from_the_factory_when_none_is_set() -> None:
    derived = CaptureConfig().with_derived(environ={}, token_factory=lambda: SECRET)
    assert derived.control_token == SECRET


def test_the_default_factory_mints_distinct_url_safe_tokens() -> None:
    first = CaptureConfig().with_derived(environ={}).control_token
    second = CaptureConfig().with_derived(environ={}).control_token
    assert first
    assert second
    assert first != second
    assert len(first) >= 32


def test_with_derived_keeps_a_set_token() -> None:
    config = CaptureConfig(control_token=SECRET)
    derived = config.with_derived(environ={"X": "y"}, token_factory=lambda: "other")
    assert derived == config


def test_a_factory_returning_an_empty_token_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        CaptureConfig().with_derived(environ={}, token_factory=lambda: "")
    assert e.value.code == "bad_token"


class _Field:
    name = "workers"


def test_the_shared_validators_raise_bad_field_codes() -> None:
    from tokcap_core.config import at_least, non_empty_text, one_of, positive_number

    cases = [
        (at_least(1), 0),
        (at_least(1), True),
        (at_least(1), 1.5),
        (positive_number, 0),
        (positive_number, float("inf")),
        (positive_number, False),
        (non_empty_text, ""),
        (non_empty_text, 3),
        (one_of("a", "b"), "c"),
    ]
    for check, value in cases:
        with pytest.raises(ConfigError) as e:
            check(None, _Field(), value)
        assert e.value.code == "bad_workers", (check, value)
    for check, value in [(at_least(1), 1), (positive_number, 0.5), (non_empty_text, "x")]:
        check(None, _Field(), value)
