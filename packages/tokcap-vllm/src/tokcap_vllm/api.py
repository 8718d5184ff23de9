"""The control plane's wire bodies (msgspec structs), for clients in any language."""

from ._api import (
    CONTROL_PREFIX,
    CloseBody,
    ErrorBody,
    Head,
    HeadResponse,
    Health,
    OpenResponse,
    ReleaseResponse,
    RolloutItem,
    RolloutPage,
    TerminalBody,
    WitnessBody,
    error_json,
)
from ._client import MANIFEST_FAILURE_BUCKET

__all__ = [
    "CONTROL_PREFIX",
    "MANIFEST_FAILURE_BUCKET",
    "CloseBody",
    "ErrorBody",
    "Head",
    "HeadResponse",
    "Health",
    "OpenResponse",
    "ReleaseResponse",
    "RolloutItem",
    "RolloutPage",
    "TerminalBody",
    "WitnessBody",
    "error_json",
]
