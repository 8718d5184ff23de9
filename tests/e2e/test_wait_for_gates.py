"""`tokcap_vllm.wait_for_gates`: a trainer started with its gates waits until each says ``ok``.

Against the shared fleet's two real ``tokcap-vllm serve`` gates (``served_fleet``) and a
port nobody listens on, over real HTTP.
"""

from __future__ import annotations

import anyio
import pytest

from tests.e2e._fleet import SharedFleet
from tests.e2e._gates import free_port
from tokcap_core import ConfigError
from tokcap_vllm import ControlAuthError, ControlUnreachable, wait_for_gates

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_every_gate_answers_ok_in_the_order_asked(served_fleet: SharedFleet) -> None:
    urls = served_fleet.urls
    answers = anyio.run(lambda: wait_for_gates(urls[::-1], served_fleet.token, timeout_s=120))
    assert [a.status for a in answers] == ["ok", "ok"]
    assert all(a.serving and a.sink_error is None for a in answers)
    assert len({a.instance for a in answers}) == 2


def test_a_wrong_token_is_refused_at_once_not_waited_out(served_fleet: SharedFleet) -> None:
    urls = served_fleet.urls
    with pytest.raises(ControlAuthError):
        anyio.run(lambda: wait_for_gates(urls, "not-the-token", timeout_s=600))


def test_a_gate_that_never_answers_is_named_with_its_last_answer(
    served_fleet: SharedFleet,
) -> None:
    live = served_fleet.urls[0]
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ControlUnreachable) as info:
        anyio.run(
            lambda: wait_for_gates([live, dead], served_fleet.token, timeout_s=3, interval_s=0.5)
        )
    assert info.value.code == "gates_not_ready"
    assert "1 of 2 gates" in info.value.message
    assert f"{dead} (" in info.value.message
    assert f"{live} (" not in info.value.message


@pytest.mark.parametrize(
    ("urls", "timeout_s", "interval_s", "code"),
    [
        ([], 1.0, 1.0, "bad_urls"),
        (["http://127.0.0.1:1"], 0.0, 1.0, "bad_timeout_s"),
        (["http://127.0.0.1:1"], float("nan"), 1.0, "bad_timeout_s"),
        (["http://127.0.0.1:1"], 1.0, -1.0, "bad_interval_s"),
    ],
)
def test_bad_arguments_are_typed(
    urls: list[str], timeout_s: float, interval_s: float, code: str
) -> None:
    with pytest.raises(ConfigError) as info:
        anyio.run(lambda: wait_for_gates(urls, "t", timeout_s=timeout_s, interval_s=interval_s))
    assert info.value.code == code
