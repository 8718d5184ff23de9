"""One served-gate fleet shared by the modules that only *use* gates (e2e, TRL).

Two ``tokcap-vllm serve --tokcap-sink tq`` processes (the real CLI, with the options
``tokcap train --gates`` gives its gates: `tokcap.compose.served_gate_options` on the
default partitions, ``--tokcap-return-token-ids``, the demo's Qwen engine options) joined
to the session's Ray + TransferQueue (``tq_cluster``). Starting them costs a minute or
more on a 2-core box; every module that drives gates someone else started (served gates
read from this process, TRL's trainers in this process, trainers and the demo in their own
processes with ``--gate URL --ray-address``) shares one start.

`SharedFleet.up` starts the gates on first use and restarts any that died (a test may
kill one: the fault test kills the second gate last). `SharedFleet.initial_weights`
puts every gate back on the tiny model's own weights (a push at a new version) when a
previous test pushed trained weights, for tests whose first step checks parity against
freshly loaded weights; `SharedFleet.unpushed` gives gates never pushed to (version 0),
starting again any that was, for a trainer that numbers its pushes from 0 (TRL's
``GRPOTrainer``). ``tests/conftest.py`` runs the modules that use the fleet one after
another (those that need it unpushed first) and stops the gates after the last of them.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import anyio

from tests.e2e._cli import REPO
from tests.e2e._gates import ServedGate
from tokcap.compose import served_gate_options
from tokcap_tq import TQSinkConfig

__all__ = ["SharedFleet"]

GATES = 2


class SharedFleet:
    """Two served gates on the Ray cluster at ``address``, started lazily (see the module).

    ``model`` is the folder ``tokcap train`` and ``tokcap demo`` load by default when run in
    the repository (``.tokcap/tiny/dense``), so their policy and checks match what the gates
    serve. The control token reaches each gate through its environment only.
    """

    def __init__(self, address: str, logs: Path) -> None:
        from tokcap.tiny import build_tiny_model

        self.address = address
        self.token = "shared-fleet-" + secrets.token_hex(8)
        self.sink = TQSinkConfig()  # the default partitions: what `--gate URL` runs read
        self.model = build_tiny_model(REPO / ".tokcap" / "tiny" / "dense", kind="dense")
        self._logs = logs
        self._gates: list[ServedGate | None] = [None] * GATES
        self._starts = 0

    def _start(self) -> ServedGate:
        from tokcap.demo import QWEN_VLLM_ARGS

        options = [
            *served_gate_options(self.sink, self.address),
            "--tokcap-return-token-ids",
            "--tokcap-attach-timeout-s",
            "120",
        ]
        self._starts += 1
        log = self._logs / f"gate-{self._starts}.log"
        return ServedGate(self.model, options, token=self.token, log=log, vllm_args=QWEN_VLLM_ARGS)

    def up(self) -> list[ServedGate]:
        """The gates, each alive and healthy: started (all at once) where missing or dead."""
        for i, gate in enumerate(self._gates):
            if gate is None or gate.process.poll() is not None:
                self._gates[i] = self._start()
        gates = [g for g in self._gates if g is not None]
        for gate in gates:
            gate.wait_healthy(self.token)
        return gates

    @property
    def urls(self) -> list[str]:
        """The gates' base URLs (after `up`)."""
        return [g.url for g in self.up()]

    def unpushed(self) -> list[ServedGate]:
        """The gates, each never pushed to (version 0, the model's own weights): a gate a
        previous test pushed to is started again."""
        gates = self.up()
        versions = anyio.run(self._versions, [g.url for g in gates])
        for i, version in enumerate(versions):
            if version != 0:
                gates[i].stop()
                self._gates[i] = None
        return self.up()

    def initial_weights(self) -> int:
        """Every gate on the model's own weights; returns the fleet's version then.

        Gates at version 0 were never pushed to; otherwise the model's weights are pushed
        to all gates at one version above the highest (versions only go up).
        """
        urls = self.urls
        return anyio.run(self._reset, urls)

    async def _versions(self, urls: list[str]) -> list[int]:
        from tokcap_vllm.weights import FleetWeightSync

        async with FleetWeightSync([(url, self.token) for url in urls]) as weights:
            return [info.version for info in await weights.infos()]

    async def _reset(self, urls: list[str]) -> int:
        from tokcap.loop import load_policy
        from tokcap_vllm.weights import FleetWeightSync

        async with FleetWeightSync([(url, self.token) for url in urls]) as weights:
            versions = [info.version for info in await weights.infos()]
            if set(versions) == {0}:
                return 0
            policy = load_policy(self.model, 0)
            state = {name: t.detach() for name, t in policy.state_dict().items()}
            version = max(versions) + 1
            await weights.push(state, version)
            return version

    def stop(self) -> None:
        """Stop every gate (a later `up` starts them again)."""
        for i, gate in enumerate(self._gates):
            if gate is not None:
                gate.stop()
            self._gates[i] = None
