"""tokcap adapter for vLLM: the capture host and the OpenAI-compatible gate.

The gate runs *inside* the user's own vLLM OpenAI server (``--middleware
tokcap_vllm.GateMiddleware``, the opt-in ``vllm.general_plugins`` entry point, or
``tokcap-vllm serve``). A harness points its OpenAI base URL at
``/tokcap/rollouts/{rollout_id}/v1`` (or sends ``X-Tokcap-Rollout-Id``); every call is
admitted against the rollout's custody ledger, generated on the exact token ids the
model produced before (``token_in``), staged into a `tokcap_core.TokenSink` off the
response path, and committed once the sink acknowledged. vLLM itself is not a
dependency: importing vLLM-facing parts without it raises an `ImportError` that names
the install command.

The trainer talks to the gate's authenticated control plane (``/tokcap/v1/...``,
`ControlPlane`) through `ControlPlaneClient`: close rollouts (keeping the ledger head),
declare terminals, fetch and verify manifests into receipts, release. With
``GateConfig.ledger_path`` the ledgers are persisted (`LedgerFile`), so a restarted gate
serves closed manifests byte-identical and poisons rollouts that were open at the crash.
Prometheus metrics are at ``/tokcap/v1/metrics``.
"""

from ._admission import message_fingerprints, normalize_message, output_fingerprint
from ._api import CloseBody, Head, HeadResponse, Health, RolloutItem, RolloutPage, TerminalBody
from ._client import MANIFEST_FAILURE_BUCKET, ControlPlaneClient
from ._config import CONTROL_TOKEN_ENV, LEDGER_PATH_ENV, GateConfig
from ._control import ControlPlane
from ._errors import (
    BadRequest,
    ControlAuthError,
    ControlConflict,
    ControlNotFound,
    ControlPlaneError,
    ControlRequestError,
    ControlUnavailable,
    ControlUnreachable,
    GateError,
    InvalidBody,
    RolloutConflict,
    RolloutNotFound,
    TooLarge,
    Unauthorized,
    Unsupported,
)
from ._gate import Gate, PendingCall
from ._hooks import GateHooks
from ._host import CaptureHost, EngineResult
from ._inproc import InProcessServer
from ._middleware import GateMiddleware, default_gate, install_gate
from ._persist import LedgerFile, LedgerFileError, read_ledger_records
from ._prom import GateMetrics
from ._vllm import INSTALL_HINT, require_vllm

__all__ = [
    "CONTROL_TOKEN_ENV",
    "INSTALL_HINT",
    "LEDGER_PATH_ENV",
    "MANIFEST_FAILURE_BUCKET",
    "BadRequest",
    "CaptureHost",
    "CloseBody",
    "ControlAuthError",
    "ControlConflict",
    "ControlNotFound",
    "ControlPlane",
    "ControlPlaneClient",
    "ControlPlaneError",
    "ControlRequestError",
    "ControlUnavailable",
    "ControlUnreachable",
    "EngineResult",
    "Gate",
    "GateConfig",
    "GateError",
    "GateHooks",
    "GateMetrics",
    "GateMiddleware",
    "Head",
    "HeadResponse",
    "Health",
    "InProcessServer",
    "InvalidBody",
    "LedgerFile",
    "LedgerFileError",
    "PendingCall",
    "RolloutConflict",
    "RolloutItem",
    "RolloutNotFound",
    "RolloutPage",
    "TerminalBody",
    "TooLarge",
    "Unauthorized",
    "Unsupported",
    "default_gate",
    "install_gate",
    "message_fingerprints",
    "normalize_message",
    "output_fingerprint",
    "read_ledger_records",
    "require_vllm",
]
