"""Request routing: which rollout (if any) a request belongs to, and the vLLM path it maps to.

A rollout is named by the path ``{prefix}{rollout_id}/v1/...`` (black-box harnesses only
change their base URL) or by a header on a plain ``/v1/...`` path. The rollout id is taken
from the *raw* path and percent-decoded once, so ``..%2f`` arrives as ``../`` and is refused
by the rollout-id grammar instead of being normalised into another path.

Nothing a rollout sends may escape capture unnoticed: a trailing slash on a captured
endpoint is captured like the endpoint (vLLM would redirect it to the plain path, and
HTTP clients follow redirects); any other POST naming a rollout, by path or by header
(``/v1/embeddings``, ``/v1/messages/count_tokens``, ``/v1/responses/{id}/cancel``, ...), is
refused (``uncaptured_endpoint``) rather than served uncaptured; requests naming no rollout
pass through untouched. Two rollout headers, or a path and a header naming different
rollouts, are refused rather than one picked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import unquote

from tokcap_core.errors import InvalidId
from tokcap_core.ids import RolloutId, validate_rollout_id

from ..errors import BadRequest, RolloutNotFound

__all__ = ["CAPTURED_ENDPOINTS", "Route", "parse_rollout_id", "route_request"]

Endpoint = Literal["chat", "completion", "messages", "responses"]
CAPTURED_ENDPOINTS: Final[dict[str, Endpoint]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
"""The APIs a rollout may call: OpenAI chat and completions, Anthropic Messages, OpenAI
Responses (the last two become chat requests inside vLLM and are planned as chat)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its rollout (None: plain traffic) and the vLLM path to serve it."""

    rollout_id: RolloutId | None
    path: str
    endpoint: Endpoint | None


def parse_rollout_id(text: str) -> RolloutId:
    """The one rollout-id parser of the gate: `BadRequest` (``bad_rollout_id``) if malformed."""
    try:
        return validate_rollout_id(text)
    except InvalidId as e:
        raise BadRequest("bad_rollout_id", e.message or str(e)) from e


def route_request(
    raw_path: bytes, path: str, method: str, headers: list[str], *, prefix: str
) -> Route:
    """Route one HTTP request; ``headers`` are the values of the rollout header, in order."""
    if len(headers) > 1:
        raise BadRequest("bad_rollout_id", "more than one rollout-id header")
    named = parse_rollout_id(headers[0]) if headers else None
    raw = raw_path.decode("latin-1").split("?", 1)[0]
    if raw.startswith(prefix):
        segment, sep, tail = raw[len(prefix) :].partition("/")
        if not sep or not ("/" + tail).startswith("/v1/"):
            raise BadRequest("bad_rollout_path", f"expected {prefix}{{rollout_id}}/v1/...")
        rollout_id = parse_rollout_id(unquote(segment))
        if named is not None and named != rollout_id:
            raise BadRequest(
                "conflicting_rollout_ids", "the path and the rollout header name different rollouts"
            )
        return _captured_route(rollout_id, unquote("/" + tail), method)
    if named is not None:
        return _captured_route(named, path, method)
    return Route(None, path, None)


def _captured_route(rollout_id: RolloutId, path: str, method: str) -> Route:
    """The route of a request naming a rollout (by path or header): the same rules for both."""
    endpoint = _endpoint(path)
    if endpoint is None and method == "POST":
        raise RolloutNotFound(
            "uncaptured_endpoint",
            f"{path} cannot be captured; rollouts call /v1/chat/completions, /v1/completions, "
            "/v1/messages or /v1/responses",
        )
    return Route(rollout_id, _canonical(path, endpoint), endpoint)


def _endpoint(path: str) -> Endpoint | None:
    return CAPTURED_ENDPOINTS.get(path.rstrip("/") if path != "/" else path)


def _canonical(path: str, endpoint: Endpoint | None) -> str:
    """A captured endpoint's path without a trailing slash (vLLM would redirect it)."""
    return path.rstrip("/") if endpoint is not None else path
