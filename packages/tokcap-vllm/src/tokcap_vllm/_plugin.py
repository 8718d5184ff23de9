"""The ``vllm.general_plugins`` entry point: opt-in gate for a stock ``vllm serve``.

vLLM loads general plugins in every process it starts. With ``TOKCAP_GATE=1`` in the
environment, `register` wraps the API server's ``build_app`` so the app it builds carries
`GateMiddleware` (the same thing ``--middleware tokcap_vllm.GateMiddleware`` does);
without it, the plugin does nothing, so installing tokcap-vllm never changes a server.
The gate is configured by the same ``TOKCAP_<FIELD>`` variables ``tokcap-vllm serve``
sets from its options (``TOKCAP_SINK`` is required; see `tokcap_vllm._served`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

__all__ = ["ENABLE_ENV", "register"]

ENABLE_ENV = "TOKCAP_GATE"
_MIDDLEWARE = "tokcap_vllm.GateMiddleware"


def register() -> None:
    """Entry point: add the gate to vLLM's OpenAI app builder when ``TOKCAP_GATE=1``."""
    if os.environ.get(ENABLE_ENV, "") not in ("1", "true", "yes"):
        return
    try:
        from vllm.entrypoints.launchers.api_server import entry
    except ImportError:  # an engine-only process or another vLLM layout: nothing to wrap
        return
    original = entry.build_app  # type: ignore[attr-defined]
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
