"""``tokcap train --harness-api``: the command offers the APIs the loop's harness speaks and
refuses another with argparse's usage and one error line; the loop's config refuses an API
the harness does not speak."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli_errors import tokcap
from tokcap.loop import HARNESS_APIS, LoopConfig
from tokcap_core import ConfigError


def test_the_help_offers_every_api_and_chat_is_the_default() -> None:
    result = tokcap("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "--harness-api {" + ",".join(HARNESS_APIS) + "}" in result.stdout
    assert HARNESS_APIS[0] == "chat"
    assert LoopConfig(model=Path("tiny")).harness_api == "chat"


def test_an_unknown_api_is_refused_in_one_line() -> None:
    result = tokcap("train", "--harness-api", "grpc")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "argument --harness-api: invalid choice: 'grpc'" in result.stderr.splitlines()[-1]


@pytest.mark.parametrize("api", HARNESS_APIS)
def test_the_config_takes_each_api(api: str) -> None:
    assert LoopConfig(model=Path("tiny"), harness_api=api).harness_api == api  # type: ignore[arg-type]


def test_the_config_refuses_an_unknown_api() -> None:
    with pytest.raises(ConfigError) as refused:
        LoopConfig(model=Path("tiny"), harness_api="grpc")  # type: ignore[arg-type]
    assert refused.value.code == "bad_harness_api"
