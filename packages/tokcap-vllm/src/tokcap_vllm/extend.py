"""For extending or embedding the gate: observers, metrics, the capture host, the control
plane as a bare ASGI handler, and `require_vllm` (every runtime import of vLLM in this
package goes through it)."""

from .control import ControlPlane
from .gate import (
    INSTALL_HINT,
    CaptureHost,
    EngineResult,
    GateCall,
    GateHealth,
    GateMetrics,
    require_vllm,
)
from .persist import GateHooks
from .server import default_gate

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
