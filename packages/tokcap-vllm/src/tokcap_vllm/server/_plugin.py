"""The ``vllm.general_plugins`` entry points: opt-in gate, and tokcap's weight transport.

vLLM loads general plugins in every process it starts (API server, engine core, workers).
With ``TOKCAP_GATE=1`` in the environment, `register` wraps the API server's ``build_app``
so the app it builds carries `GateMiddleware` (the same thing ``--middleware
tokcap_vllm.GateMiddleware`` does); without it, the plugin does nothing, so installing
tokcap-vllm never changes a server. The gate is configured by the same ``TOKCAP_<FIELD>``
variables ``tokcap-vllm serve`` sets from its options (``TOKCAP_SINK`` is required; see
`tokcap_vllm.gate._served`). `register_weight_transfer` always registers the ``tokcap_shm``
weight-transfer backend (lazily, by module path: nothing is imported until an engine
selects it with ``--weight-transfer-config '{"backend": "tokcap_shm"}'``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ..gate import require_vllm

__all__ = ["ENABLE_ENV", "register", "register_weight_transfer"]

ENABLE_ENV = "TOKCAP_GATE"
_MIDDLEWARE = "tokcap_vllm.GateMiddleware"


def register() -> None:
    """Entry point: add the gate to vLLM's OpenAI app builder when ``TOKCAP_GATE=1``."""
    if os.environ.get(ENABLE_ENV, "") not in ("1", "true", "yes"):
        return
    try:
        entry = require_vllm("vllm.entrypoints.launchers.api_server.entry")
    except ImportError:  # an engine-only process or another vLLM layout: nothing to wrap
        return
    original = entry.build_app
    if getattr(original, "__tokcap__", False):
        return

    @functools.wraps(original)
    def build_app(args: Any, *rest: Any, **kwargs: Any) -> Any:
        middleware = list(getattr(args, "middleware", None) or [])
        if _MIDDLEWARE not in middleware:
            args.middleware = [*middleware, _MIDDLEWARE]
        return original(args, *rest, **kwargs)

    build_app.__tokcap__ = True  # type: ignore[attr-defined]
    entry.build_app = build_app  # type: ignore[attr-defined]


def register_weight_transfer() -> None:
    """Entry point: register ``tokcap_shm`` with vLLM's worker- and trainer-side factories.

    Idempotent (vLLM loads plugins once per process, but a process may import vLLM twice
    through different entry points); without vLLM's weight-transfer package, a no-op.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return
    module = "tokcap_vllm.transfer"
    for factory, name in (
        (WeightTransferEngineFactory, "TokcapShmWeightTransferEngine"),
        (WeightTransferTrainerFactory, "TokcapShmTrainerWeightTransferEngine"),
    ):
        if _BACKEND not in factory._registry:
            factory.register_engine(_BACKEND, module, name)


_BACKEND = "tokcap_shm"
