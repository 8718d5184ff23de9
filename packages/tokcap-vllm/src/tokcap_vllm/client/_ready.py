"""`wait_for_gates`: until every gate of a fleet says it can take captured calls.

A trainer is often started together with its gates (one launcher, one job array): the
gates take about a minute to load their engine, and a served gate with
``--tokcap-sink tq`` only serves once it has attached to the TransferQueue the trainer
starts. Polling the health route is the one wait that covers both.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from tokcap_core import ConfigError

from ..api import Health
from ..errors import ControlAuthError, ControlPlaneError, ControlUnreachable
from ._client import ControlPlaneClient

__all__ = ["wait_for_gates"]


async def wait_for_gates(
    urls: Sequence[str], token: str, *, timeout_s: float, interval_s: float = 2.0
) -> list[Health]:
    """Poll every gate's ``GET /tokcap/v1/health`` (all at once) until each answers with
    status ``ok``; return their answers in the order of ``urls``.

    ``ok`` means serving with nothing that stops or stalls a captured call (the sink
    attached, the ledger file writable, the weights not failed, the engine running); a
    ``degraded`` gate is waited for like one that does not answer yet. A wrong ``token``
    raises `ControlAuthError` at once (waiting would not mend it). A gate that has not
    said ``ok`` within ``timeout_s`` raises `ControlUnreachable` ``gates_not_ready``,
    naming every such gate with its last answer. Bad arguments raise
    `tokcap_core.ConfigError` (``bad_urls``, ``bad_timeout_s``, ``bad_interval_s``).
    """
    if not urls:
        raise ConfigError("bad_urls", "wait_for_gates needs at least one gate url")
    for name, value in (("timeout_s", timeout_s), ("interval_s", interval_s)):
        if not value > 0:
            raise ConfigError(f"bad_{name}", f"{name} must be a positive number, got {value!r}")
    answers: list[Health | None] = [None] * len(urls)
    last = ["no answer yet"] * len(urls)
    refused: list[ControlAuthError] = []

    async def poll(i: int, url: str, scope: anyio.CancelScope) -> None:
        async with ControlPlaneClient(url, token, retries=0, timeout_s=10.0) as client:
            while True:
                try:
                    health = await client.health()
                except ControlAuthError as e:
                    refused.append(e)
                    scope.cancel()
                    return
                except ControlPlaneError as e:
                    last[i] = str(e)
                else:
                    if health.status == "ok":
                        answers[i] = health
                        return
                    why = health.sink_error or health.ledger_error or f"weights {health.weights}"
                    last[i] = f"status {health.status}: {why}, engine {health.engine}"
                await anyio.sleep(interval_s)

    with anyio.move_on_after(timeout_s) as deadline:
        async with anyio.create_task_group() as group:
            for i, url in enumerate(urls):
                group.start_soon(poll, i, url, group.cancel_scope)
    if refused:
        raise refused[0]
    if deadline.cancelled_caught:
        waiting = [f"{url} ({last[i]})" for i, url in enumerate(urls) if answers[i] is None]
        raise ControlUnreachable(
            "gates_not_ready",
            f"{len(waiting)} of {len(urls)} gates not ok within {timeout_s:g} s: "
            + "; ".join(waiting),
        )
    return [answer for answer in answers if answer is not None]
