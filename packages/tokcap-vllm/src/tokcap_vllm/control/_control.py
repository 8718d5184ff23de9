"""The control plane: the trainer's authenticated HTTP door to the gate's ledgers.

Routes (all under ``/tokcap/v1/``, all behind ``Authorization: Bearer <token>``):

- ``GET  health`` (503 while the gate is not serving; ``degraded`` with what stops or stalls
  captured calls: the ledger file, the sink, the weights, the engine's own state, asked of
  the engine each time) · ``GET metrics`` (Prometheus text)
- ``GET  routes`` — every route the server mounts and how the gate answers it
- ``GET  rollouts?state=open|closed&limit=N&after=ID`` (ascending ids, paged)
- ``GET  rollouts/{id}/manifest`` — exactly ``encode_manifest`` bytes
- ``POST rollouts/{id}/open`` — hold a rollout before its first call (a gate run with
  ``require_open`` refuses calls of rollouts nobody opened: 404 ``unknown_rollout``)
- ``POST rollouts/{id}/terminal`` `TerminalBody` · ``POST rollouts/{id}/close`` `CloseBody`
  — both answer the ledger head; close answers once the head is durable
- ``POST close`` `CloseManyBody` — close many rollouts with ONE durable write (group
  commit: they close concurrently, then one fsync covers every head); the answer holds one
  `CloseOutcome` per rollout, in order: its head, or the status and code its own close
  would have answered (a rollout that failed never hides the others' heads); with
  ``manifests``, each closed rollout's manifest too (the bytes of ``GET …/manifest``,
  left out over the manifest bound), saving the trainer a request per rollout; an item's
  ``terminal`` is declared first (as ``POST …/terminal``; refused: left open, that answer)
- ``DELETE rollouts/{id}`` — the gate forgets a closed rollout (sink keys are the trainer's)

Statuses: 400 bad JSON or id, a duplicated ``Authorization`` header, or a token in the
query string (refused, and redacted from the request before any access log sees it);
401 no/wrong token; 404 unknown rollout or route; 405; 409 an illegal ledger transition
(the ledger's code: ``rollout_closed``, ``terminal_already_declared``, ...); 413 manifest
over the bound; 422 a body that decodes but is invalid; 503 no token configured, the head
could not be made durable, or the gate is down. The token is compared in constant time
and never appears in a log line, ``repr``, metric or error.
"""

from __future__ import annotations

import contextlib
import hmac
import os
from collections.abc import Mapping
from typing import TypeVar
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode

import anyio
import msgspec

from tokcap_core.ids import RolloutId
from tokcap_core.ledger import Entry, Witnesses, encode_manifest, manifest_of

from ..api import (
    CONTROL_PREFIX,
    MAX_CLOSE_BATCH,
    CloseBody,
    CloseManyBody,
    CloseManyResponse,
    CloseOutcome,
    Head,
    HeadResponse,
    Health,
    OpenResponse,
    ReleaseResponse,
    RolloutItem,
    RolloutPage,
    RouteItem,
    RouteTable,
    TerminalBody,
    error_json,
)
from ..errors import (
    BadRequest,
    ControlUnavailable,
    GateError,
    InvalidBody,
    MethodNotAllowed,
    RolloutNotFound,
    TooLarge,
    Unauthorized,
)
from ..gate import METRICS_CONTENT_TYPE, Gate, decode_json, describe_sink, parse_rollout_id
from ._asgi import Receive, Scope, Send, header_values, read_body, send_body
from ._close_body import as_gate_error, close_witnesses, failed_outcome, ledger_errors
from ._route_table import route_listing

__all__ = ["ControlPlane"]

_Body = TypeVar("_Body", TerminalBody, CloseBody, CloseManyBody)

_MAX_BODY = 1 << 20
INSTANCE_HEADER = b"x-tokcap-gate-instance"
"""On every answer: the gate's instance id (a restarted gate has a new one)."""
_ENGINE_PROBE_S = 5.0
_SECRET_PARAMS = frozenset({"token", "access_token", "authorization", "auth", "bearer", "key"})


class _Reply:
    __slots__ = ("body", "content_type", "status")

    def __init__(
        self, body: bytes, *, status: int = 200, content_type: bytes = b"application/json"
    ) -> None:
        self.body, self.status, self.content_type = body, status, content_type


def _json(value: msgspec.Struct, status: int = 200) -> _Reply:
    return _Reply(msgspec.json.encode(value), status=status)


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
            status = type(e).status
            reply = _Reply(error_json(e.code, e.message, status), status=status)
        except RecursionError:  # a witness nested past Python's recursion limit
            reply = _Reply(error_json("bad_json", "the body is nested too deeply", 400), status=400)
        headers = [(b"www-authenticate", b"Bearer")] if reply.status == 401 else []
        headers.append((INSTANCE_HEADER, self.gate.instance.encode("ascii")))
        await send_body(
            send, reply.status, reply.body, content_type=reply.content_type, headers=headers
        )

    def authorize(self, scope: Scope) -> None:
        """Raise unless ``scope`` carries the control token (the same check as every route)."""
        self._authorize(scope)

    def _authorize(self, scope: Scope) -> None:
        if _redact_query(scope):
            raise BadRequest(
                "token_in_query", "send the token in the Authorization header, never in the URL"
            )
        if self._token is None:
            raise ControlUnavailable(
                "control_plane_disabled",
                "no control token configured (CaptureConfig.control_token or the variable "
                "named by control_token_env, default TOKCAP_CONTROL_TOKEN)",
            )
        values = header_values(scope, b"authorization")
        if len(values) > 1:
            raise BadRequest("duplicate_authorization", "more than one Authorization header")
        given = b""
        if values:
            scheme, _, credentials = values[0].encode("latin-1").partition(b" ")
            if scheme.lower() == b"bearer":
                given = credentials.strip()
        if not hmac.compare_digest(given, self._token):
            raise Unauthorized("unauthorized", "a valid bearer token is required")

    async def _route(self, scope: Scope, receive: Receive) -> _Reply:
        owners = header_values(scope, b"x-tokcap-owner")
        if len(owners) > 1 or (owners and not 0 < len(owners[0]) <= 128):
            raise BadRequest("bad_owner", "X-Tokcap-Owner is one value of 1..128 characters")
        owner = owners[0] if owners else None
        self.gate.touch_owner(owner)
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1").split("?", 1)[0]
        parts = raw[len(CONTROL_PREFIX) :].split("/")
        method = scope.get("method", "GET")
        if parts == ["health"]:
            _allow(method, "GET")
            return self._health(await engine_state(scope))
        if parts == ["routes"]:
            _allow(method, "GET")
            return _json(_routes(scope))
        if parts == ["metrics"]:
            _allow(method, "GET")
            return _Reply(self.gate.telemetry.render(), content_type=METRICS_CONTENT_TYPE.encode())
        if parts == ["close"]:
            _allow(method, "POST")
            return await self._close_many(await _body(receive, CloseManyBody), owner)
        if parts == ["rollouts"]:
            _allow(method, "GET")
            return self._list(scope.get("query_string", b""))
        if len(parts) in (2, 3) and parts[0] == "rollouts":
            rollout_id = parse_rollout_id(unquote(parts[1]))
            action = parts[2] if len(parts) == 3 else None
            if action is None:
                _allow(method, "DELETE")
                return await self._release(rollout_id, owner)
            if action == "manifest":
                _allow(method, "GET")
                return _Reply(self._manifest(rollout_id))
            if action == "terminal":
                _allow(method, "POST")
                entry = self._declare(rollout_id, await _body(receive, TerminalBody), owner)
                head = Head(seq=entry.seq, hash=entry.hash)
                return _json(HeadResponse(rollout_id=rollout_id, head=head))
            if action == "open":
                _allow(method, "POST")
                await read_body(receive, _MAX_BODY)
                with ledger_errors():
                    await self.gate.open_fresh(rollout_id, owner=owner)
                held = self.gate.book.owners.of(rollout_id)
                return _json(OpenResponse(rollout_id, True, held, self.gate.instance))
            if action == "close":
                _allow(method, "POST")
                return await self._close(rollout_id, await _body(receive, CloseBody), owner)
        raise RolloutNotFound("unknown_route", f"no control route {raw}")

    # ---- handlers ---------------------------------------------------------------------

    def _health(self, engine: str) -> _Reply:
        health = self.gate.health(engine)
        sink, warnings = describe_sink(self.gate.sink)
        body = Health(
            sink=sink,
            warnings=warnings,
            status=health.status,  # type: ignore[arg-type]
            serving=health.serving,
            rollouts_open=health.rollouts_open,
            rollouts_closed=health.rollouts_closed,
            ledger_file=self.gate.ledger_file is not None,
            ledger_error=health.ledger_problem,
            instance=self.gate.instance,
            sink_error=health.sink_problem,
            weights=health.weights,
            engine=health.engine,
        )
        return _json(body, status=503 if health.status == "down" else 200)

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
        owners = self.gate.book.holders()
        items = [RolloutItem(rid, s, owners.get(rid)) for rid, s in page]  # type: ignore[arg-type]
        return _json(RolloutPage(rollouts=items, next_cursor=next_cursor))

    def _manifest(self, rollout_id: str) -> bytes:
        """The manifest's bytes; `TooLarge` over the gate's bound."""
        body = encode_manifest(manifest_of(self.gate.book.ledger(rollout_id)))
        bound = self.gate.config.max_manifest_bytes
        if len(body) > bound:
            raise TooLarge(
                "manifest_too_large", f"the manifest is {len(body)} bytes, the bound is {bound}"
            )
        return body

    def _closed_outcome(self, rollout_id: str, head: Head, manifests: bool) -> CloseOutcome:
        """A closed rollout's answer in a batch close, with its manifest if asked and within
        the bound (over it, the trainer's ``GET …/manifest`` gets the 413), and still held
        (released while the close was made durable, it gets the 404)."""
        outcome = CloseOutcome(rollout_id=rollout_id, head=head)
        if manifests:  # set only when present: an empty Raw would be encoded as nothing
            with contextlib.suppress(TooLarge, RolloutNotFound):
                outcome.manifest = msgspec.Raw(self._manifest(rollout_id))
        return outcome

    def _declare(self, rollout_id: RolloutId, body: TerminalBody, owner: str | None) -> Entry:
        """Name the terminal call (``POST …/terminal``, a batch close's ``terminal``)."""
        if (body.call_id is None) == (body.response_id is None):
            raise InvalidBody("bad_body", "give exactly one of call_id, response_id")
        with ledger_errors():
            return self.gate.declare_terminal(
                rollout_id, call_id=body.call_id, response_id=body.response_id, owner=owner
            )

    async def _close(self, rollout_id: RolloutId, body: CloseBody, owner: str | None) -> _Reply:
        witnesses = close_witnesses(body.reward, body.witnesses)
        with ledger_errors():
            seq, head = await self.gate.close(rollout_id, body.reward, witnesses, owner=owner)
        return _json(HeadResponse(rollout_id=rollout_id, head=Head(seq=seq, hash=head)))

    async def _close_many(self, body: CloseManyBody, owner: str | None) -> _Reply:
        items = body.rollouts
        if len(items) > MAX_CLOSE_BATCH:
            raise InvalidBody("bad_body", f"at most {MAX_CLOSE_BATCH} rollouts per close")
        if len({item.rollout_id for item in items}) != len(items):
            raise InvalidBody("bad_body", "a rollout id is listed more than once")
        results: list[CloseOutcome | None] = [None] * len(items)
        closes: list[tuple[str, float | None, Witnesses | None]] = []
        asked: list[int] = []
        for index, item in enumerate(items):
            try:
                rollout_id = parse_rollout_id(item.rollout_id)
                witnesses = close_witnesses(item.reward, item.witnesses)
                if item.terminal is not None:  # declared, then closed: no round trip between
                    self._declare(rollout_id, item.terminal, owner)
            except GateError as e:
                results[index] = failed_outcome(item.rollout_id, e)
                continue
            closes.append((rollout_id, item.reward, witnesses))
            asked.append(index)
        answers = await self.gate.close_many(closes, owner=owner)
        for index, answer in zip(asked, answers, strict=True):
            asked_id = items[index].rollout_id
            if isinstance(answer, tuple):
                head = Head(seq=answer[0], hash=answer[1])
                results[index] = self._closed_outcome(asked_id, head, body.manifests)
                continue
            results[index] = failed_outcome(asked_id, as_gate_error(answer))
        return _json(CloseManyResponse(results=[r for r in results if r is not None]))

    async def _release(self, rollout_id: RolloutId, owner: str | None) -> _Reply:
        self.gate.release(rollout_id, owner=owner)
        await self.gate.free_media()
        file = self.gate.ledger_file
        if file is not None and file.should_compact:
            await file.compact(self.gate.held_ledgers)
        return _json(ReleaseResponse(rollout_id=rollout_id, released=True))


def _routes(scope: Scope) -> RouteTable:
    """Every route of the server's app (empty outside one), as the gate answers it."""
    routes = getattr(scope.get("app"), "routes", [])
    return RouteTable(
        routes=[
            RouteItem(path, methods, rule.access, rule.reason, rule.listed)
            for path, methods, rule in route_listing(routes)
        ]
    )


async def engine_state(scope: Scope) -> str:
    """The engine's own state (see `Health.engine`), asked within `_ENGINE_PROBE_S`."""
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if engine is None:
        return "unknown"
    with anyio.move_on_after(_ENGINE_PROBE_S):
        if await engine.is_paused():  # vLLM's pause is a sleep of level 0: asked first
            return "paused"
        return "asleep" if await engine.is_sleeping() else "running"
    return "unresponsive"


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise MethodNotAllowed("method_not_allowed", f"use {allowed}")


def _redact_query(scope: Scope) -> bool:
    """Blank secret-looking query parameters in place (uvicorn's access log reads the same
    scope); True if there were any."""
    query = scope.get("query_string", b"")
    if not query:
        return False
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if not any(name.lower() in _SECRET_PARAMS for name, _ in pairs):
        return False
    kept = [(n, "redacted" if n.lower() in _SECRET_PARAMS else v) for n, v in pairs]
    scope["query_string"] = urlencode(kept).encode("latin-1")
    return True


def _one(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidBody("bad_query", f"{name} given more than once")
    return values[0]


async def _body(receive: Receive, kind: type[_Body]) -> _Body:
    return decode_json(await read_body(receive, _MAX_BODY), kind, "body", InvalidBody)
