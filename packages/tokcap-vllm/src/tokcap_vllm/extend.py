"""For extending or embedding the gate: observers, metrics, the capture host, the control
plane as a bare ASGI handler, and `require_vllm` (every runtime import of vLLM in this
package goes through it)."""

from .control._control import ControlPlane
from .gate._gate import GateHealth
from .gate._host import CaptureHost, EngineResult
from .gate._metrics import GateMetrics
from .gate._records import GateCall
from .gate._vllm import INSTALL_HINT, require_vllm
from .persist._hooks import GateHooks
from .server._middleware import default_gate

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
