"""Every route vLLM's server mounts, classified: public (with why), guarded or refused (pure).

vLLM mounts routes from many places: its own routers (the OpenAI and Anthropic APIs, the
RL and dev routes with ``VLLM_SERVER_DEV_MODE=1``, LoRA with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, ``--enable-scale-out``'s token routes, ...),
FastAPI's docs, and ``sagemaker_standards`` (``/ping``, ``/invocations``, ``/adapters``).
vLLM puts no authentication on any of them. The gate answers each request by this table:

- **public** (`PUBLIC`, each with its reason): inference and what a client or a load
  balancer asks before it (a rollout's calls are captured on its path or with the rollout
  header, see `tokcap_vllm.gate._routing`; other traffic is served uncaptured), liveness;
- **guarded** (`GUARDED_PATHS`): the control token is required (``Authorization:
  Bearer``); anything that changes or reveals the engine beyond serving;
- **refused** (`REFUSED`): answered 403 even with the token, because no rule of the gate
  can record what it does: a LoRA adapter loaded or unloaded at run time changes what
  captured calls sample with, and no weight version would say so; ``/collective_rpc`` runs
  any method on every worker.

A path in none of them (a route a vLLM release or a plugin adds) is guarded: the list
fails closed. ``GET /tokcap/v1/routes`` lists the server's real routes with their class
(`route_listing`), and a test checks that none is left to the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "GUARDED_PATHS",
    "PUBLIC",
    "REFUSED",
    "RouteRule",
    "normalized_path",
    "route_listing",
    "rule_of",
]

Access = Literal["public", "guarded", "refused"]

RL_PATHS: Final = frozenset(
    {
        "/pause",
        "/resume",
        "/abort_requests",
        "/is_paused",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_info",
        "/weight_checker",
        "/get_world_size",
    }
)
DEV_PATHS: Final = frozenset(
    {
        "/collective_rpc",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/release_kv_cache_memory",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/server_info",
    }
)
ADMIN_PATHS: Final = frozenset(
    {
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/start_profile",
        "/stop_profile",
        "/fault_tolerance/apply",
        "/fault_tolerance/status",
        "/load",  # requests in flight: engine state
        "/kv_event_sources",  # the KV-event publishers' endpoints
        "/openapi.json",  # the server's whole route map
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/invocations",  # SageMaker's dispatcher: every handler, sessions, adapter injection
        "/inference/v1/abort_requests",  # anyone's requests (--enable-scale-out)
    }
)
GUARDED_PATHS: Final = RL_PATHS | DEV_PATHS | ADMIN_PATHS
"""Every vLLM route that changes or reveals the engine beyond serving: token required."""

_ADAPTERS = (
    "a LoRA adapter loaded or unloaded at run time changes what captured calls sample with, "
    "and no weight version records it: load adapters at start (--lora-modules), or push "
    "merged weights through the weight routes"
)
_ANY_METHOD = (
    "runs any method on every worker (__init__, sleep, reload_weights, ...), which no rule "
    "of the gate could record"
)
REFUSED: Final[Mapping[str, str]] = {
    "/collective_rpc": _ANY_METHOD,
    "/v1/load_lora_adapter": _ADAPTERS,
    "/v1/unload_lora_adapter": _ADAPTERS,
    "/adapters": _ADAPTERS,
    "/adapters/{adapter_name}": _ADAPTERS,
}
"""Routes refused (403 ``route_refused``) even with the token, and why."""

_INFERENCE = (
    "inference: captured on a rollout's path or with the rollout header, else served uncaptured"
)
_UNCAPTURED = "inference the gate never captures (the rollout header on it is refused)"
PUBLIC: Final[Mapping[str, str]] = {
    "/health": "liveness as vLLM answers it; nothing about the engine or rollouts",
    "/ping": "SageMaker's liveness probe (vLLM's /health)",
    "/version": "vLLM's version string",
    "/metrics": "vLLM's own Prometheus counters (tokcap's are behind the token)",
    "/v1/models": "the served model's name: what an OpenAI client asks first",
    "/v1/chat/completions": _INFERENCE,
    "/v1/completions": _INFERENCE,
    "/v1/messages": _INFERENCE,
    "/v1/responses": _INFERENCE,
    "/v1/responses/{response_id}": "a stored response, named by its unguessable id",
    "/v1/responses/{response_id}/cancel": "a background response, named by its unguessable id",
    "/v1/chat/completions/batch": _UNCAPTURED,
    "/v1/messages/count_tokens": _UNCAPTURED,
    "/tokenize": _UNCAPTURED,
    "/detokenize": _UNCAPTURED,
    "/v1/chat/completions/render": _UNCAPTURED,
    "/v1/completions/render": _UNCAPTURED,
    "/v1/messages/render": _UNCAPTURED,
    "/v1/responses/render": _UNCAPTURED,
    "/v1/chat/completions/derender": _UNCAPTURED,
    "/v1/completions/derender": _UNCAPTURED,
    "/generative_scoring": _UNCAPTURED,
    "/v1/systemone": _UNCAPTURED,
    "/inference/v1/generate": _UNCAPTURED,
}
"""Routes anyone may call, and why that is safe."""
_MOUNTS: Final = ("/metrics",)  # mounted apps: every path below them is theirs


@dataclass(frozen=True, slots=True)
class RouteRule:
    """How the gate answers a route: its access, why, and whether the table names it."""

    access: Access
    reason: str
    listed: bool = True


_UNLISTED = RouteRule("guarded", "not in the gate's route table: guarded by default", False)


def normalized_path(path: str, root_path: str = "") -> str:
    """``path`` without the server's root path, doubled slashes or a trailing slash."""
    if root_path and path.startswith(root_path):
        path = path[len(root_path) :]
    while "//" in path:
        path = path.replace("//", "/")
    return path.rstrip("/") or "/"


def _matches(template: str, path: str) -> bool:
    if "{" not in template:
        return template == path
    want, have = template.split("/"), path.split("/")
    return len(want) == len(have) and all(
        w == h or (w.startswith("{") and w.endswith("}") and h != "")
        for w, h in zip(want, have, strict=True)
    )


def rule_of(path: str) -> RouteRule:
    """The rule for a normalized path (`normalized_path`); unlisted paths are guarded.
    `REFUSED` is asked first: a refused route may be among the guarded ones by name."""
    for template, reason in REFUSED.items():
        if _matches(template, path):
            return RouteRule("refused", reason)
    if path in GUARDED_PATHS:
        return RouteRule("guarded", "changes or reveals the engine beyond serving")
    for template, reason in PUBLIC.items():
        if _matches(template, path):
            return RouteRule("public", reason)
    for mount in _MOUNTS:
        if path.startswith(mount + "/"):
            return RouteRule("public", PUBLIC[mount])
    return _UNLISTED


def route_listing(routes: Iterable[Any]) -> list[tuple[str, list[str], RouteRule]]:
    """``(path, methods, rule)`` for each route of a Starlette app's ``routes`` (a mount's
    methods are empty); a template is classified as its own path."""
    out = []
    for route in routes:
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue
        methods = sorted(getattr(route, "methods", None) or [])
        out.append((path, methods, rule_of(normalized_path(path))))
    return out
