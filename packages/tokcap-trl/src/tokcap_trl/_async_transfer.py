"""TRL's weight-transfer interface for ``AsyncGRPOTrainer``, on tokcap's fleet push.

``AsyncGRPOTrainer`` syncs weights as ``pause()``, ``send_weights(iterator of (name,
tensor))``, ``resume()`` (once at train begin, then every ``weight_sync_steps``), and
counts its policy versions itself (``model_version``: 1 after the first sync). Two things
it does not give a transfer, and what `GateWeightTransfer` does about them:

- **The tied head.** TRL streams ``named_parameters()``, which omits a tied
  ``lm_head.weight``; the engine needs the whole state dict (pushing only the embedding
  left it 4.9 nats off, measured). The gate's weight spec names its tied pairs; the head
  is added from the streamed embedding. Anything else missing is refused by the push's own
  check (``missing_tensors``): a partial push never reaches an engine.
- **The version.** None is passed. `PolicyVersions` counts: the fleet's version when the
  transfer was initialised is TRL's version 0, and the n-th push loads gate version
  ``base + n``, so TRL's ``model_version`` and the ``weight_version`` the gates stamp on
  every staged call map one to one (`PolicyVersions.trainer_version`); the rollout worker
  reports samples in TRL's numbering through the same object.

``pause`` is a no-op by design: tokcap's push pauses each engine itself, inside the swap
(mode ``wait``: calls in flight finish on the old weights, new ones queue), so rollouts
keep playing while TRL gathers the tensors. ``resume`` checks that every gate now serves
the pushed version, ready and unheld. A failed push raises `TRLAdapterError`
``weight_push_failed`` (the fleet stays held until a push succeeds on every gate); a
``resume`` that finds the fleet on another version raises ``weight_version_mismatch``.
Neither is retried or swallowed: TRL's trainer stops with the error.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from tokcap_core import TokcapError

from ._errors import TRLAdapterError

if TYPE_CHECKING:
    import torch

    from tokcap_vllm.weights import FleetWeightSync

__all__ = ["GateWeightTransfer", "PolicyVersions"]

T = TypeVar("T")
Call = Callable[[Callable[[], Awaitable[Any]]], Any]
"""Runs a coroutine function on the adapter's event loop from TRL's thread (a portal)."""


class PolicyVersions:
    """TRL's policy versions against the gates' weight versions (thread-safe).

    ``base`` is the fleet's version when training began (TRL's version 0); TRL's version
    ``k`` is gate version ``base + k``. Set once by `GateWeightTransfer`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base: int | None = None
        self._pushed = 0

    @property
    def started(self) -> bool:
        """Whether the base is known (the transfer was initialised)."""
        with self._lock:
            return self._base is not None

    @property
    def base(self) -> int:
        """The gates' version that is TRL's version 0."""
        with self._lock:
            if self._base is None:
                raise TRLAdapterError("not_started", "the weight transfer was not initialised")
            return self._base

    @property
    def current(self) -> int:
        """TRL's version of the last completed push (0 before the first)."""
        with self._lock:
            return self._pushed

    def start(self, base: int) -> None:
        """Take the fleet's version ``base`` as TRL's version 0."""
        with self._lock:
            self._base, self._pushed = base, 0

    def pushed(self) -> int:
        """Count a completed push; TRL's version it loaded."""
        with self._lock:
            self._pushed += 1
            return self._pushed

    def gate_version(self, trainer_version: int) -> int:
        """The gates' version that TRL's ``trainer_version`` is."""
        return self.base + trainer_version

    def trainer_version(self, gate_version: int) -> int:
        """TRL's version for the gates' ``gate_version`` (negative: before training)."""
        return gate_version - self.base


class GateWeightTransfer:
    """``weight_transfer=`` for ``AsyncGRPOTrainer``: every sync is one tokcap fleet push.

    ``weights`` pushes to every gate (`tokcap_vllm.weights.FleetWeightSync`); ``call`` runs
    a coroutine function on the event loop that owns it (an anyio blocking portal's
    ``call``). ``versions`` is shared with the rollout worker. See the module.
    """

    def __init__(self, weights: FleetWeightSync, call: Call, versions: PolicyVersions) -> None:
        self._weights = weights
        self._call = call
        self.versions = versions
        self.pushes: list[int] = []
        """The gate versions pushed, in order."""

    def init_weight_transfer(self) -> None:
        """Read the fleet's version (every gate must agree, ready and unheld): TRL's 0."""
        current = self._call(self._weights.current_version)
        if current is None:
            infos = self._call(self._weights.infos)
            raise TRLAdapterError(
                "weight_version_mismatch",
                f"the gates do not serve one weight version, ready and unheld: {infos}",
            )
        self.versions.start(current)

    def pause(self) -> None:
        """Nothing: tokcap's push pauses each engine inside its swap (see the module)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push the streamed tensors, with the tied head added, as the next version."""
        state = dict(iterator)
        _, tied = self._call(self._weights.clients[0].spec)
        for head, embedding in tied:
            if head not in state and embedding in state:
                state[head] = state[embedding]
        version = self.versions.gate_version(self.versions.current + 1)

        async def push() -> None:
            await self._weights.push(state, version)

        try:
            self._call(push)
        except TokcapError as e:
            raise TRLAdapterError(
                "weight_push_failed",
                f"pushing TRL's version {self.versions.current + 1} (gate version {version}) "
                f"failed: {e.code}: {e}",
            ) from e
        self.versions.pushed()
        self.pushes.append(version)

    def resume(self) -> None:
        """Check every gate serves the version just pushed, ready and unheld."""
        expected = self.versions.gate_version(self.versions.current)
        current = self._call(self._weights.current_version)
        if current != expected:
            infos = self._call(self._weights.infos)
            raise TRLAdapterError(
                "weight_version_mismatch",
                f"after the push the gates should serve version {expected}: {infos}",
            )

    def destroy(self) -> None:
        """Nothing to release: the fleet's connections belong to whoever opened them."""
