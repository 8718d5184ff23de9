"""The ASGI middleware that turns vLLM's own OpenAI server into the tokcap gate.

``--middleware tokcap_vllm.GateMiddleware`` (or the ``vllm.general_plugins`` entry point,
or ``tokcap-vllm serve``) puts it in front of vLLM's routes. Plain traffic passes through
untouched. A captured call (``/tokcap/rollouts/{id}/v1/...`` or the rollout header) is
decoded and admitted, then handed to vLLM's own handler on the ``/v1/...`` path with a
`Ticket` in its context, so chat templates, tool and reasoning parsers stay vLLM's. The
response is watched on its way out; just before its last byte the call is indexed as a
parent and its commit scheduled. On lifespan start-up the middleware runs `Gate.serve`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

from ._admission import (
    message_fingerprints,
    normalize_message,
    output_fingerprint,
    plan_chat,
    plan_completion,
)
from ._api import CONTROL_PREFIX
from ._config import GateConfig
from ._control import ControlPlane
from ._errors import BadRequest, GateError
from ._gate import Gate, PendingCall
from ._host import CURRENT_TICKET, CaptureHost, Ticket
from ._routing import route_request
from ._wire import (
    ChatBody,
    CompletionBody,
    ResponseObserver,
    decode_body,
    error_body,
    read_body,
)

__all__ = ["GateMiddleware", "default_gate", "install_gate"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_installed: Gate | None = None


def install_gate(gate: Gate) -> Gate:
    """Make ``gate`` the one `GateMiddleware` uses when vLLM builds it by import path."""
    global _installed
    _installed = gate
    return gate


def default_gate() -> Gate:
    """The installed gate, or a new one with a `MemorySink` (installed on first use).

    A new gate is configured from the environment (`GateConfig.from_environ`: the ledger
    file from ``TOKCAP_LEDGER_PATH``).
    """
    if _installed is not None:
        return _installed
    return install_gate(Gate(GateConfig.from_environ(os.environ)))


class GateMiddleware:
    """ASGI middleware: routes rollout calls through admission and capture, the rest through."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], gate: Gate | None = None
    ) -> None:
        self.app = app
        self.gate = gate if gate is not None else default_gate()
        self._host: CaptureHost | None = None
        self._templates: dict[str | None, str | None] = {}
        self._control = ControlPlane(self.gate)  # part 2: /tokcap/v1/...

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith(CONTROL_PREFIX):  # part 2: the control plane
            await self._control(scope, receive, send)
            return
        config = self.gate.config
        raw_headers = [
            (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", ())
        ]
        headers = dict(raw_headers)
        try:
            if sum(k == config.rollout_header.lower() for k, _ in raw_headers) > 1:
                # two rollout headers (e.g. a CRLF-split value) are ambiguous: never pick one
                raise BadRequest("bad_rollout_id", "more than one rollout-id header")
            route = route_request(
                scope.get("raw_path") or scope["path"].encode(),
                scope["path"],
                headers,
                prefix=config.path_prefix,
                header=config.rollout_header,
            )
        except GateError as e:
            await _send_error(send, e)
            return
        if route.rollout_id is None:
            await self.app(scope, receive, send)
            return
        inner = dict(scope, path=route.path, raw_path=route.path.encode())
        if route.endpoint is None or scope.get("method") != "POST":
            await self.app(inner, receive, send)
            return
        try:
            await self._captured(inner, receive, send, route.rollout_id, route.endpoint, headers)
        except GateError as e:
            await _send_error(send, e)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gate.running:
            await self.app(scope, receive, send)
            return
        async with anyio.create_task_group() as tg:
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

    async def _captured(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        rollout_id: str,
        kind: str,
        headers: dict[str, str],
    ) -> None:
        body = await read_body(receive, self.gate.config.max_body_bytes)
        parsed = decode_body(body, kind)
        host = self._capture_host(scope)
        rollout = self.gate.rollout_for_call(rollout_id)
        replay_receive = _replaying(body, receive)
        if rollout is None:
            await self.app(scope, replay_receive, send)
            return
        key = headers.get(self.gate.config.idempotency_header)
        earlier = self.gate.replay_of(rollout, key)
        if earlier is not None:
            with anyio.move_on_after(self.gate.config.parent_commit_timeout_s):
                await earlier.settled.wait()
            if earlier.phase == "committed" and earlier.replay is not None:
                start, chunks = earlier.replay
                await send(start)
                for i, chunk in enumerate(chunks):
                    await send(
                        {
                            "type": "http.response.body",
                            "body": chunk,
                            "more_body": i < len(chunks) - 1,
                        }
                    )
                return
        messages, plan_fn = self._planner(scope, host, parsed)
        call = await self.gate.admit(
            rollout, plan_fn, kind=kind, messages=messages, idempotency_key=key
        )
        ticket = Ticket(
            prompt_ids=call.plan.prompt_ids,
            on_finish=lambda result: self.gate.engine_finished(call, result),
        )
        observer = ResponseObserver(keep=key is not None)

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                observer.on_start(dict(message))
            elif message["type"] == "http.response.body":
                observer.on_body(message.get("body", b""))
                if not message.get("more_body", False):
                    observer.finish()
                    self._respond(call, host, observer, messages)
            await send(message)

        token = CURRENT_TICKET.set(ticket)
        try:
            await self.app(scope, replay_receive, watch)
        finally:
            CURRENT_TICKET.reset(token)
            if call.phase in ("admitted", "finished"):
                detail = (
                    "client_disconnected"
                    if observer.status in (0, 200)
                    else f"http_{observer.status}"
                )
                await self.gate.abandon(call, detail)

    def _planner(
        self, scope: Scope, host: CaptureHost, parsed: ChatBody | CompletionBody
    ) -> tuple[Any, Any]:
        tokenizer = host.tokenizer
        markers = self.gate.config.reasoning_markers

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        if isinstance(parsed, CompletionBody):
            prompt = parsed.prompt
            return None, lambda priors, _: plan_completion(prompt, priors=priors, encode=encode)
        messages = [normalize_message(m) for m in parsed.messages]
        template = self._template(scope, parsed.chat_template)
        args = getattr(scope["app"].state, "args", None)
        kwargs = dict(getattr(args, "default_chat_template_kwargs", None) or {})
        kwargs.update(parsed.chat_template_kwargs or {})
        tools = parsed.tools

        def render(msgs: Any, add_generation_prompt: bool) -> str:
            text = tokenizer.apply_chat_template(
                [dict(m) for m in msgs],
                tools=tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            return str(text)

        def plan(priors: Any, gen_starts: Any) -> Any:
            return plan_chat(
                messages,
                priors=priors,
                gen_starts=gen_starts,
                render=render,
                encode=encode,
                add_generation_prompt=parsed.add_generation_prompt,
                markers=markers,
            )

        return messages, plan

    def _template(self, scope: Scope, requested: str | None) -> str | None:
        if requested is not None:
            return requested
        if None not in self._templates:
            args = getattr(scope["app"].state, "args", None)
            configured = getattr(args, "chat_template", None)
            if configured is not None:
                from vllm.renderers.chat_utils import load_chat_template

                configured = load_chat_template(configured)
            self._templates[None] = configured
        return self._templates[None]

    def _respond(
        self, call: PendingCall, host: CaptureHost, observer: ResponseObserver, messages: Any
    ) -> None:
        """The last byte is about to go out: index the call as a parent, schedule its commit."""
        if observer.status != 200 or call.result is None:
            return
        result = call.result
        tool_calls = observer.tool_calls()
        output_fp = output_fingerprint(observer.content, tool_calls)
        conversation_fp = None
        if call.kind == "chat":
            generated = host.tokenizer.decode(list(result.output_ids), skip_special_tokens=False)
            cum_text = call.plan.prompt_text + generated
            assistant = normalize_message(
                {"role": "assistant", "content": observer.content, "tool_calls": tool_calls}
            )
            conversation_fp = message_fingerprints([*messages, assistant])[-1]
        else:
            cum_text = call.plan.prompt_text + result.text if call.plan.prompt_text else ""
        if observer.chunks is not None and observer.start is not None:
            call.replay = (observer.start, observer.chunks)
        self.gate.response_complete(
            call,
            response_id=observer.response_id,
            output_fp=output_fp,
            cum_text=cum_text,
            conversation_fp=conversation_fp,
        )


def _replaying(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, error: GateError) -> None:
    status = type(error).status
    body = error_body(error.code, error.message, status)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
