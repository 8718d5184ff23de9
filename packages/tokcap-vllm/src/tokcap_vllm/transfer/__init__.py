"""tokcap's CPU transport as a vLLM weight-transfer engine (``tokcap_shm``): see `_engine`.

The engine classes import vLLM and torch, so they load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._engine import (
        BACKEND,
        BearerWeightSyncClient,
        StateDictSource,
        TokcapShmInitInfo,
        TokcapShmTrainerInitInfo,
        TokcapShmTrainerWeightTransferEngine,
        TokcapShmUpdateInfo,
        TokcapShmWeightTransferEngine,
    )

__all__ = [
    "BACKEND",
    "BearerWeightSyncClient",
    "StateDictSource",
    "TokcapShmInitInfo",
    "TokcapShmTrainerInitInfo",
    "TokcapShmTrainerWeightTransferEngine",
    "TokcapShmUpdateInfo",
    "TokcapShmWeightTransferEngine",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
