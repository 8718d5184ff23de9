"""The gate in vLLM's OpenAI server: the ASGI door and the ways it gets there.

- `GateMiddleware` (``_middleware``): the ASGI middleware; which requests are captured,
  handing each to the gate's capture path and to vLLM's own handler, the control plane's
  and the guarded routes' requests to `tokcap_vllm.control`; `install_gate` adds it to an
  app, `default_gate` is the gate it builds from ``TOKCAP_*``;
- ``tokcap-vllm serve`` (``_serve``): vLLM's CLI with the gate's options;
- `InProcessServer` (``_inproc``): vLLM's server with the gate in a thread of this process;
- the ``vllm.general_plugins`` entry points (``_plugin``): the opt-in gate and the
  ``tokcap_shm`` weight-transfer backend.
"""

from ._inproc import InProcessServer
from ._middleware import GateMiddleware, default_gate, install_gate

__all__ = ["GateMiddleware", "InProcessServer", "default_gate", "install_gate"]
