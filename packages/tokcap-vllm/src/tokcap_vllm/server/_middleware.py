"""The ASGI middleware that turns vLLM's own OpenAI server into the tokcap gate.

``--middleware tokcap_vllm.GateMiddleware`` (or the ``vllm.general_plugins`` entry point,
or ``tokcap-vllm serve``) puts it in front of vLLM's routes. Plain traffic passes through
untouched. A captured call (``/tokcap/rollouts/{id}/v1/...`` or the rollout header) is
decoded and handed to the capture path (`CapturePath.enter`), which has it admitted; then
to vLLM's own handler on the ``/v1/...`` path with the `Ticket` the capture path made in
its context, so chat templates, tool and reasoning parsers stay vLLM's. The response is
watched on its way out: what went out is handed to the capture path once just before its
last byte (`CapturePath.response_complete`, which may refuse it) and once when vLLM's
handler returned (`CapturePath.response_ended`); the door reads nothing of the call and
decides nothing of how it ends. On lifespan start-up the middleware runs `Gate.serve`.

Every refusal is a typed error answer (`GateError`, with its HTTP status and a stable
``code``: 4xx for what the request got wrong, 503 for what the gate cannot take now);
anything unexpected while capturing one request answers 500 ``gate_failed`` for that
request alone and is logged: it never reaches vLLM's server or the gate's task group.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import anyio

from ..api import CONTROL_PREFIX, error_json
from ..control import (
    App,
    ControlPlane,
    GuardedRoutes,
    Message,
    Receive,
    Scope,
    Send,
    guarded_path,
    header_values,
    normalized_path,
    read_body,
    rule_of,
    send_body,
)
from ..errors import BadRequest, GateError, Unsupported
from ..gate import (
    CURRENT_TICKET,
    AnswerAgain,
    CaptureHost,
    Flag,
    Gate,
    RequestRenderer,
    ResponseObserver,
    Serve,
    decode_request,
    fetch_remote_media,
    planned_on,
    request_renderer,
    route_request,
    served_gate,
    stream_error_event,
)

__all__ = ["GateMiddleware", "default_gate", "install_gate"]

_log = logging.getLogger("tokcap_vllm.gate")
_installed: Gate | None = None
_installed_attach: Callable[[], AbstractAsyncContextManager[None]] | None = None


def install_gate(
    gate: Gate, *, attach: Callable[[], AbstractAsyncContextManager[None]] | None = None
) -> Gate:
    """Make ``gate`` the one `GateMiddleware` uses when vLLM builds it by import path;
    ``attach()`` is entered on the server's start-up, before the gate serves."""
    global _installed, _installed_attach
    _installed, _installed_attach = gate, attach
    return gate


def default_gate() -> Gate:
    """The installed gate, or the one the ``TOKCAP_*`` variables describe (installed on
    first use; see `tokcap_vllm.gate._served`: ``TOKCAP_SINK`` is required)."""
    if _installed is not None:
        return _installed
    served = served_gate(environ=os.environ)
    assert served is not None
    return install_gate(served.gate, attach=served.attach)


class GateMiddleware:
    """ASGI middleware: routes rollout calls through admission and capture, the rest through."""

    def __init__(self, app: App, gate: Gate | None = None) -> None:
        self.app = app
        self.gate = gate if gate is not None else default_gate()
        self._attach = _installed_attach if gate is None else None
        self._host: CaptureHost | None = None
        self._renderer: RequestRenderer | None = None
        self._control = ControlPlane(self.gate)
        self._guarded = GuardedRoutes(self.gate, self._control)
        self._rollout_header = self.gate.config.rollout_header.lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if guarded_path(scope) is not None:  # vLLM's RL/dev/admin routes, tokcap's weights
            await self._guarded(scope, receive, send, self.app)
            return
        if scope["path"].startswith(CONTROL_PREFIX):
            await self._control(scope, receive, send)
            return
        try:
            route = route_request(
                scope.get("raw_path") or scope["path"].encode(),
                scope["path"],
                scope.get("method", "GET"),
                header_values(scope, self._rollout_header),
                prefix=self.gate.config.path_prefix,
            )
        except GateError as e:
            await self._refuse(send, e)
            return
        inner = dict(scope, path=route.path, raw_path=route.path.encode())
        if route.endpoint is None or scope.get("method") != "POST":
            served = normalized_path(route.path, scope.get("root_path") or "")
            if rule_of(served).access != "public":  # guarded or refused, listed or not
                await self._guarded(inner, receive, send, self.app)
            elif route.rollout_id is None:
                await self.app(scope, receive, send)
            else:
                await self.app(inner, receive, send)
            return
        assert route.rollout_id is not None
        await self._captured(inner, receive, send, route.rollout_id, route.endpoint)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gate.running:
            await self.app(scope, receive, send)
            return
        attached = self._attach() if self._attach is not None else contextlib.nullcontext()
        async with attached, anyio.create_task_group() as tg:
            await tg.start(self.gate.serve)
            try:
                await self.app(scope, receive, send)
            finally:
                tg.cancel_scope.cancel()

    def _capture_host(self, scope: Scope) -> CaptureHost:
        if self._host is None:
            engine = scope["app"].state.engine_client
            host = getattr(engine, "_tokcap_host", None)
            if host is None:
                host = CaptureHost(engine, default_weight_version=self.gate.config.weight_version)
                host.install()
            self._host = host
        return self._host

    def _request_renderer(self, scope: Scope, host: CaptureHost) -> RequestRenderer:
        if self._renderer is None:
            args = getattr(scope["app"].state, "args", None)
            max_len = int(host.engine.model_config.max_model_len)
            renderer = request_renderer(host.tokenizer, args, self.gate.config, max_len)
            renderer.takes_images = bool(
                getattr(host.engine.model_config, "is_multimodal_model", False)
            )
            self._renderer = renderer
        return self._renderer

    async def _refuse(self, send: Send, error: GateError) -> None:
        self.gate.telemetry.refused.labels(error.code).inc()
        status = type(error).status
        await send_body(send, status, error_json(error.code, error.message, status))

    async def _captured(
        self, scope: Scope, receive: Receive, send: Send, rollout_id: str, kind: str
    ) -> None:
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            body = await read_body(receive, self.gate.config.max_body_bytes)
            host = self._capture_host(scope)
            allowed = self.gate.config.allow_remote_media
            decoded = await decode_request(
                kind,
                body
                if not allowed  # the gate fetches nothing (and makes no visit for it)
                else await fetch_remote_media(
                    body, allowed, timeout_s=self.gate.config.remote_media_timeout_s
                ),
                app_state=scope["app"].state,
                book=self.gate.book,
                rollout_id=rollout_id,
                token_ids_allowed=self.gate.config.capture.return_token_ids,
                header_request_id=_one_header(scope, "x-request-id"),
            )
            parsed, parent = decoded.parsed, decoded.parent
            if parsed.seed is not None and host.seeded_prefill_chunks_crash:
                raise Unsupported(
                    "seed_unsupported",
                    "a seeded request would crash this vLLM CPU engine when its prefill is "
                    "chunked (vLLM's CPU generators cannot rewind); drop `seed`, or serve with "
                    "--no-enable-chunked-prefill and --max-num-batched-tokens >= max_model_len",
                )
            renderer = self._request_renderer(scope, host)
            entered = await self.gate.capture.enter(
                rollout_id,
                kind=decoded.planned_kind,
                request=lambda: planned_on(renderer.request(parsed), parent),
                idempotency_key=_one_header(scope, self.gate.config.idempotency_header),
                body_fingerprint=hashlib.sha256(body).hexdigest(),
                request_id=decoded.request_id,
                thread=decoded.thread,
                structured_outputs=decoded.structured_outputs,
            )
            if isinstance(entered, AnswerAgain):  # a retry of a call that settled
                await _answer_again(send, entered)
                return
            self.gate.telemetry.by_api.labels(kind).inc()
            body_again = _receive_body_again(decoded.body, receive, entered.call.abandoned)
            await self._generate(scope, body_again, watched_send, entered, kind)
        except (GateError, RecursionError) as e:
            if not started:
                await self._refuse(send, _typed(e))
        except Exception as e:  # containment: one request's failure answers for itself alone
            _log.exception("tokcap gate: a captured request of %s failed", rollout_id)
            if not started:
                error = GateError(
                    "gate_failed", f"the gate failed on this request ({type(e).__name__})"
                )
                self.gate.telemetry.refused.labels(error.code).inc()
                await send_body(send, 500, error_json(error.code, error.message, 500))

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, served: Serve, kind: str
    ) -> None:
        """Run vLLM's handler on the admitted call, watching its response go out: what the
        capture path must know of it is handed over at its last byte and when it ends."""
        capture, call = self.gate.capture, served.call
        observer = ResponseObserver(keep=call.idempotency_key is not None, kind=kind)
        held: list[Message] = []  # a plain answer is held until the gate says it may complete
        ended = False  # the harness's response is over (complete, or ended with an error)
        handed = False  # the capture path heard how the response ended (its last byte)

        async def end_with(error: GateError) -> None:
            nonlocal ended
            ended = True
            self.gate.telemetry.refused.labels(error.code).inc()
            status = type(error).status
            if observer.streaming:  # the stream is under way: an error event, then the end
                event = stream_error_event(kind, error.code, error.message, status)
                await send({"type": "http.response.body", "body": event, "more_body": False})
            else:
                await send_body(send, status, error_json(error.code, error.message, status))

        async def watch(message: Message) -> None:
            nonlocal ended, handed
            if ended:
                return
            if message["type"] == "http.response.start":
                observer.on_start(dict(message))
                if not observer.streaming and observer.status == 200:
                    held.append(message)
                    return
            elif message["type"] == "http.response.body":
                last = not message.get("more_body", False)
                observer.on_body(message.get("body", b""))
                if held and not last:
                    held.append(message)
                    return
                if (last or observer.stream_done) and not observer.done:
                    observer.finish()
                    refusal = await capture.response_complete(call, observer)
                    handed = True
                    if refusal is not None:
                        await end_with(refusal)
                        return
                ended = last
            for pending in held:
                await send(pending)
            held.clear()
            await send(message)

        token = CURRENT_TICKET.set(served.ticket)
        refusal = None
        try:
            await self.app(scope, receive, watch)
        finally:
            CURRENT_TICKET.reset(token)
            if not handed:  # it ended before its last byte: the capture path hears it now
                refusal = await capture.response_ended(call, observer)
        if refusal is not None and not ended:  # closed while generating: vLLM stopped
            await end_with(refusal)


def _typed(error: GateError | RecursionError) -> GateError:
    """A refusal's typed error: a recursion limit hit anywhere in the request's JSON (a
    template, a tool schema, ...) is the caller's nesting, a 400 like any bad JSON."""
    if isinstance(error, RecursionError):
        return BadRequest("bad_json", "the request is nested too deeply")
    return error


def _one_header(scope: Scope, name: str) -> str | None:
    values = header_values(scope, name.lower().encode("latin-1"))
    if len(values) > 1:
        raise BadRequest("duplicate_header", f"more than one {name} header")
    return values[0] if values else None


def _receive_body_again(body: bytes, receive: Receive, abandoned: Flag | None) -> Receive:
    """The request's body once, then the client's messages; an ``http.disconnect`` as soon
    as the gate abandons the call, so vLLM ends the request (and aborts it in the engine)
    exactly as if the client had left."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if abandoned is None:
            return await receive()
        message: Message = {"type": "http.disconnect"}
        async with anyio.create_task_group() as tg:

            async def from_client() -> None:
                nonlocal message
                message = await receive()
                tg.cancel_scope.cancel()

            async def on_abandon() -> None:
                await abandoned.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(from_client)
            tg.start_soon(on_abandon)
        return message

    return receive_again


async def _answer_again(send: Send, earlier: AnswerAgain) -> None:
    """Send the recorded answer of the call that holds the idempotency key."""
    await send(earlier.start)
    chunks = earlier.chunks
    for i, chunk in enumerate(chunks):
        await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})
