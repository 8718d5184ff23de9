"""For extending or embedding the gate: observers, metrics, the capture host, the control
plane as a bare ASGI handler, and `require_vllm` (every runtime import of vLLM in this
package goes through it)."""

from ._control import ControlPlane
from ._gate import GateHealth
from ._hooks import GateHooks
from ._host import CaptureHost, EngineResult
from ._metrics import GateMetrics
from ._middleware import default_gate
from ._records import GateCall
from ._vllm import INSTALL_HINT, require_vllm

__all__ = [
    "INSTALL_HINT",
    "CaptureHost",
    "ControlPlane",
    "EngineResult",
    "GateCall",
    "GateHealth",
    "GateHooks",
    "GateMetrics",
    "default_gate",
    "require_vllm",
]
