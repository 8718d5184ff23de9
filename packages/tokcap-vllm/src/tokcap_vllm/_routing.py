"""Request routing: which rollout (if any) a request belongs to, and the vLLM path it maps to.

A rollout is named by the path ``{prefix}{rollout_id}/v1/...`` (black-box harnesses only
change their base URL) or by a header on a plain ``/v1/...`` path. The rollout id is taken
from the *raw* path and percent-decoded once, so ``..%2f`` arrives as ``../`` and is refused
by the rollout-id grammar instead of being normalised into another path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import unquote

from tokcap_core import InvalidId
from tokcap_core.ids import validate_rollout_id

from ._errors import BadRequest

__all__ = ["CAPTURED_ENDPOINTS", "Route", "route_request"]

Endpoint = Literal["chat", "completion"]
CAPTURED_ENDPOINTS: Final[dict[str, Endpoint]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
}


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its rollout (None: plain traffic) and the vLLM path to serve it."""

    rollout_id: str | None
    path: str
    endpoint: Endpoint | None


def route_request(
    raw_path: bytes, path: str, headers: dict[str, str], *, prefix: str, header: str
) -> Route:
    """Route one HTTP request; `BadRequest` (``bad_rollout_id``) for a malformed rollout id."""
    raw = raw_path.decode("latin-1").split("?", 1)[0]
    if raw.startswith(prefix):
        rest = raw[len(prefix) :]
        segment, sep, tail = rest.partition("/")
        if not sep or not ("/" + tail).startswith("/v1/"):
            raise BadRequest("bad_rollout_path", f"expected {prefix}{{rollout_id}}/v1/...")
        rollout_id = _rollout_id(unquote(segment))
        vllm_path = unquote("/" + tail)
        return Route(rollout_id, vllm_path, CAPTURED_ENDPOINTS.get(vllm_path))
    named = headers.get(header)
    if named is not None:
        return Route(_rollout_id(named), path, CAPTURED_ENDPOINTS.get(path))
    return Route(None, path, None)


def _rollout_id(value: str) -> str:
    try:
        return validate_rollout_id(value)
    except InvalidId as e:
        raise BadRequest("bad_rollout_id", e.message or str(e)) from e
