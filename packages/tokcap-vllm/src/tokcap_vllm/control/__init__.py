"""The control plane: the trainer's authenticated HTTP door to a gate, inside vLLM's server.

- `ControlPlane` (``_control``): ``/tokcap/v1/...``, the gate's ledgers (manifests,
  terminals, closes, releases, health, the route listing) behind the control token;
- `GuardedRoutes` (``_guarded_routes``): vLLM's RL, development and admin routes behind
  the same token, and tokcap's weight routes (``/tokcap/v1/weights``), whose answers move
  what the gate knows of the engine's weights (``_served_weights``);
- the route table (``_route_table``, pure): every route vLLM's server mounts, public,
  guarded or refused;
- the ASGI vocabulary these routes and the gate's middleware speak (``_asgi``).

The wire bodies are `tokcap_vllm.api`; the trainer's clients are `tokcap_vllm.client`.
"""

from ._asgi import App, Message, Receive, Scope, Send, header_values, read_body, send_body
from ._control import ControlPlane
from ._guarded_routes import GUARDED_PATHS, GuardedRoutes, guarded_path
from ._route_table import normalized_path, rule_of

__all__ = [
    "GUARDED_PATHS",
    "App",
    "ControlPlane",
    "GuardedRoutes",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "guarded_path",
    "header_values",
    "normalized_path",
    "read_body",
    "rule_of",
    "send_body",
]
