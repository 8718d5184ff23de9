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
"""

from ._admission import message_fingerprints, normalize_message, output_fingerprint
from ._config import GateConfig
from ._errors import BadRequest, GateError, RolloutConflict, RolloutNotFound, Unsupported
from ._gate import Gate, PendingCall
from ._host import CaptureHost, EngineResult
from ._inproc import InProcessServer
from ._middleware import GateMiddleware, default_gate, install_gate
from ._vllm import INSTALL_HINT, require_vllm

__all__ = [
    "INSTALL_HINT",
    "BadRequest",
    "CaptureHost",
    "EngineResult",
    "Gate",
    "GateConfig",
    "GateError",
    "GateMiddleware",
    "InProcessServer",
    "PendingCall",
    "RolloutConflict",
    "RolloutNotFound",
    "Unsupported",
    "default_gate",
    "install_gate",
    "message_fingerprints",
    "normalize_message",
    "output_fingerprint",
    "require_vllm",
]
