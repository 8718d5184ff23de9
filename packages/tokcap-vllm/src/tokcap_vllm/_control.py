"""The control plane: the trainer's authenticated HTTP door to the gate's ledgers.

Routes (all under ``/tokcap/v1/``, all behind ``Authorization: Bearer <token>``):

- ``GET  health`` · ``GET metrics`` (Prometheus text of this gate)
- ``GET  rollouts?state=open|closed&limit=N&after=ID`` (ascending ids, paged)
- ``GET  rollouts/{id}/manifest`` — exactly ``encode_manifest`` bytes
- ``POST rollouts/{id}/terminal`` `TerminalBody` · ``POST rollouts/{id}/close`` `CloseBody`
  — both answer the ledger head; close answers once the head is durable
- ``DELETE rollouts/{id}`` — the gate forgets a closed rollout (sink keys are the trainer's)

Statuses: 400 bad JSON or id, 401 no/wrong token, 404 unknown rollout or route, 405,
409 an illegal ledger transition (the ledger's code: ``rollout_closed``,
``terminal_already_declared``, ...), 413 manifest over the bound, 422 a body that decodes
but is invalid, 503 no token configured or the ledger file failed. The token is compared
in constant time and never appears in a log line, ``repr``, metric or error.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

import msgspec

from tokcap_core import InvalidId, LedgerProtocolError
from tokcap_core.ids import validate_rollout_id
from tokcap_core.ledger import Closed, Witnesses, encode_manifest, manifest_of

from ._admission import output_fingerprint
from ._api import (
    CONTROL_PREFIX,
    CloseBody,
    Head,
    HeadResponse,
    Health,
    ReleaseResponse,
    RolloutItem,
    RolloutPage,
    TerminalBody,
    error_json,
)
from ._errors import (
    BadRequest,
    ControlUnavailable,
    GateError,
    InvalidBody,
    RolloutConflict,
    RolloutNotFound,
    TooLarge,
    Unauthorized,
)
from ._gate import Gate
from ._persist import LedgerFileError
from ._prom import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ._wire import read_body

__all__ = ["ControlPlane"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
_Body = TypeVar("_Body", TerminalBody, CloseBody)

_MAX_BODY = 1 << 20
_JSON = b"application/json"


class _Reply:
    __slots__ = ("body", "content_type", "status")

    def __init__(self, body: bytes, *, status: int = 200, content_type: bytes = _JSON) -> None:
        self.body, self.status, self.content_type = body, status, content_type


def _json(value: msgspec.Struct) -> _Reply:
    return _Reply(msgspec.json.encode(value))


class ControlPlane:
    """ASGI handler for ``/tokcap/v1/...`` over one `Gate` (`GateMiddleware` dispatches to it)."""

    def __init__(self, gate: Gate, *, environ: Mapping[str, str] | None = None) -> None:
        self.gate = gate
        token = gate.config.resolve_token(os.environ if environ is None else environ)
        self._token = token.encode("utf-8") if token is not None else None

    def __repr__(self) -> str:
        return f"ControlPlane(enabled={self._token is not None})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self._authorize(scope)
            reply = await self._route(scope, receive)
        except GateError as e:
            reply = _Reply(error_json(e.code, e.message, type(e).status), status=type(e).status)
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [
                    (b"content-type", reply.content_type),
                    (b"content-length", str(len(reply.body)).encode()),
                    *([(b"www-authenticate", b"Bearer")] if reply.status == 401 else []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})

    def _authorize(self, scope: Scope) -> None:
        if self._token is None:
            raise ControlUnavailable(
                "control_plane_disabled",
                "no control token configured (GateConfig.control_token or the variable "
                "named by control_token_env)",
            )
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, credentials = bytes(value).partition(b" ")
                if scheme.lower() == b"bearer":
                    given = credentials.strip()
        if not hmac.compare_digest(given, self._token):
            raise Unauthorized("unauthorized", "a valid bearer token is required")

    async def _route(self, scope: Scope, receive: Receive) -> _Reply:
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1").split("?", 1)[0]
        parts = raw[len(CONTROL_PREFIX) :].split("/")
        method = scope.get("method", "GET")
        if parts == ["health"]:
            _allow(method, "GET")
            return self._health()
        if parts == ["metrics"]:
            _allow(method, "GET")
            return _Reply(self.gate.prometheus.render(), content_type=METRICS_CONTENT_TYPE.encode())
        if parts == ["rollouts"]:
            _allow(method, "GET")
            return self._list(scope.get("query_string", b""))
        if len(parts) in (2, 3) and parts[0] == "rollouts":
            rollout_id = _rollout_id(parts[1])
            action = parts[2] if len(parts) == 3 else None
            if action is None:
                _allow(method, "DELETE")
                return await self._release(rollout_id)
            if action == "manifest":
                _allow(method, "GET")
                return self._manifest(rollout_id)
            if action == "terminal":
                _allow(method, "POST")
                return self._terminal(rollout_id, await _body(receive, TerminalBody))
            if action == "close":
                _allow(method, "POST")
                return await self._close(rollout_id, await _body(receive, CloseBody))
        raise RolloutNotFound("unknown_route", f"no control route {raw}")

    # ---- handlers ---------------------------------------------------------------------

    def _health(self) -> _Reply:
        states = self.gate.rollouts().values()
        file = self.gate.ledger_file
        error = file.error if file is not None else None
        return _json(
            Health(
                status="ok" if error is None else "degraded",
                serving=self.gate.running,
                rollouts_open=sum(1 for s in states if s == "open"),
                rollouts_closed=sum(1 for s in states if s == "closed"),
                ledger_file=file is not None,
                ledger_error=error,
            )
        )

    def _list(self, query: bytes) -> _Reply:
        params = parse_qs(query.decode("latin-1"), keep_blank_values=True)
        state = _one(params, "state")
        if state not in (None, "open", "closed"):
            raise InvalidBody("bad_query", "state must be 'open' or 'closed'")
        after = _one(params, "after")
        limit_text = _one(params, "limit")
        bound = self.gate.config.max_page_size
        try:
            limit = bound if limit_text is None else int(limit_text)
        except ValueError:
            raise InvalidBody("bad_query", "limit must be an integer") from None
        if not 1 <= limit <= bound:
            raise InvalidBody("bad_query", f"limit must be in [1, {bound}]")
        ids = sorted(
            (rid, s)
            for rid, s in self.gate.rollouts().items()
            if (state is None or s == state) and (after is None or rid > after)
        )
        page = ids[:limit]
        next_cursor = page[-1][0] if len(ids) > limit else None
        items = [RolloutItem(rollout_id=rid, state=s) for rid, s in page]  # type: ignore[arg-type]
        return _json(RolloutPage(rollouts=items, next_cursor=next_cursor))

    def _manifest(self, rollout_id: str) -> _Reply:
        body = encode_manifest(manifest_of(self.gate.ledger(rollout_id)))
        bound = self.gate.config.max_manifest_bytes
        if len(body) > bound:
            raise TooLarge(
                "manifest_too_large", f"the manifest is {len(body)} bytes, the bound is {bound}"
            )
        return _Reply(body)

    def _terminal(self, rollout_id: str, body: TerminalBody) -> _Reply:
        if (body.call_id is None) == (body.response_id is None):
            raise InvalidBody("bad_body", "give exactly one of call_id, response_id")
        with _ledger_errors():
            entry = self.gate.declare_terminal(
                rollout_id, call_id=body.call_id, response_id=body.response_id
            )
        return _json(HeadResponse(rollout_id=rollout_id, head=Head(seq=entry.seq, hash=entry.hash)))

    async def _close(self, rollout_id: str, body: CloseBody) -> _Reply:
        w = body.witnesses
        fingerprint = None
        if w is not None:
            if w.content_fingerprint is not None and (w.content is not None or w.tool_calls):
                raise InvalidBody("bad_body", "give content or content_fingerprint, not both")
            fingerprint = w.content_fingerprint
            if w.content is not None or w.tool_calls:
                with _ledger_errors():
                    fingerprint = output_fingerprint(w.content, w.tool_calls)
        with _ledger_errors():
            witnesses = Witnesses(
                response_id=w.response_id if w is not None else None,
                content_fingerprint=fingerprint,
            )
            Closed(reward=body.reward, witnesses=witnesses)  # refuse a bad reward before draining
            seq, head = await self.gate.close(rollout_id, body.reward, witnesses)
        return _json(HeadResponse(rollout_id=rollout_id, head=Head(seq=seq, hash=head)))

    async def _release(self, rollout_id: str) -> _Reply:
        if self.gate.rollouts().get(rollout_id) == "open":
            raise RolloutConflict("rollout_open", f"{rollout_id} is open; close it first")
        self.gate.release(rollout_id)
        file = self.gate.ledger_file
        if file is not None and file.should_compact:
            await file.compact(self.gate.held_ledgers)
        return _json(ReleaseResponse(rollout_id=rollout_id, released=True))


@contextmanager
def _ledger_errors() -> Iterator[None]:
    """Map core errors raised by a gate operation to control-plane statuses."""
    try:
        yield
    except LedgerProtocolError as e:
        if e.code == "bad_event_field":
            raise InvalidBody("bad_body", e.message) from e
        raise RolloutConflict(e.code, e.message) from e
    except InvalidId as e:
        raise BadRequest(e.code, e.message) from e
    except LedgerFileError as e:
        raise ControlUnavailable(e.code, e.message) from e


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise _MethodNotAllowed("method_not_allowed", f"use {allowed}")


class _MethodNotAllowed(GateError, ValueError):
    status = 405


def _rollout_id(segment: str) -> str:
    try:
        return validate_rollout_id(unquote(segment))
    except InvalidId as e:
        raise BadRequest("bad_rollout_id", e.message or str(e)) from e


def _one(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidBody("bad_query", f"{name} given more than once")
    return values[0]


async def _body(receive: Receive, kind: type[_Body]) -> _Body:
    raw = await read_body(receive, _MAX_BODY)
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise InvalidBody("bad_body", f"invalid body: {e}") from e
    except msgspec.DecodeError as e:
        raise BadRequest("bad_json", f"body is not JSON: {e}") from e
