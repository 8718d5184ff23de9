"""``tokcap train --harness-api``, engine-free: the flag reaches the loop's config, and the
config refuses an API the harness does not speak."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokcap.__main__ import _options, _parser
from tokcap.loop import LoopConfig
from tokcap.loop._cli import TrainOptions
from tokcap.loop._task import HARNESS_APIS
from tokcap_core import ConfigError


@pytest.mark.parametrize("api", HARNESS_APIS)
def test_the_flag_reaches_the_train_options(api: str) -> None:
    options = _options(TrainOptions, _parser().parse_args(["train", "--harness-api", api]))
    assert options.harness_api == api
    assert LoopConfig(model=Path("tiny"), harness_api=options.harness_api).harness_api == api


def test_chat_is_the_default_and_an_unknown_api_is_refused() -> None:
    assert _options(TrainOptions, _parser().parse_args(["train"])).harness_api == "chat"
    with pytest.raises(SystemExit):
        _parser().parse_args(["train", "--harness-api", "grpc"])
    with pytest.raises(ConfigError) as refused:
        LoopConfig(model=Path("tiny"), harness_api="grpc")  # type: ignore[arg-type]
    assert refused.value.code == "bad_harness_api"
