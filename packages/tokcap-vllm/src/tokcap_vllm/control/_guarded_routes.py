"""vLLM's RL, development and admin routes behind the gate's control token; the weight routes.

vLLM 0.32 mounts with ``VLLM_SERVER_DEV_MODE=1`` the RL routes (``/pause``, ``/resume``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ...) and the dev
routes (``/collective_rpc``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``,
``/server_info``, ...); ``/scale_elastic_ep`` is mounted even without it, and the LoRA,
profiler and fault-tolerance routes with their own switches. vLLM puts no authentication
on any of them: anyone who reaches the port could swap the weights or run a method on
every worker. `tokcap_vllm.control._route_table` classifies every route the server mounts; a
request to one that is not public answers 401 unless it carries the control token
(``Authorization: Bearer``, compared in constant time by `ControlPlane.authorize`), and
one the table refuses (runtime LoRA adapter changes) answers 403 ``route_refused`` even
with it.

A guarded vLLM route that raises (vLLM's weight routes do, on a failed RPC) is answered
here with a JSON 500 ``engine_route_failed``, so the connection survives and the client
reads why. Authorised weight routes are watched on their way through: their answers move
the gate's
`ServedWeights` (``_served_weights``), which the gate reads before admitting a captured
call. tokcap's own weight routes, under ``/tokcap/v1/weights``:

- ``GET  weights`` — `WeightInfo`: the gate's weight state and the engine's version label
- ``GET  weights/spec`` — what a push must carry (`WeightSpec`, read from the checkpoint)
- ``POST weights/hold`` `HoldBody` — refuse captured calls until released (the fleet's hold)
- ``POST weights/release`` — lift the hold (409 ``weights_not_ready`` unless READY)
- ``PUT  weights/upload`` — a push file's bytes, streamed; written into shared memory on
  this host (`UploadResponse`: its path for ``/update_weights``). Files uploaded are removed
  once the next ``/finish_weight_update`` that follows an update has answered; at most
  `MAX_PENDING_UPLOADS` wait for it (a newer upload removes the oldest, whose push then
  fails typed: ``push_file_missing`` or ``push_file_changed``).

Before vLLM sees them, the routes that would change what the ledger records are asked
about (`_admit`; a refusal is a typed answer and vLLM never runs): a label
(``/finish_weight_update``'s ``weight_version``, ``/update_weight_version``'s
``new_version``) must be a version above the one served (`ServedWeights.check_label`: 422
``bad_version`` or ``version_not_increasing``, nothing changes); a push file named by
``/update_weights`` must be one a worker would read (`tokcap_vllm.transfer._shm.check_push_file`:
422 with the file's code, and the push fails as any failed update does);
``/collective_rpc`` is refused by the route table (403 ``route_refused``): it runs any
method on every worker (``__init__``, ``sleep``, ``reload_weights``, ...), which nothing
could record. ``/sleep``
and ``/wake_up`` pass and are watched (`ServedWeights.slept`, `ServedWeights.woke`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import Any, Final
from urllib.parse import parse_qs

import anyio
import msgspec

from ..api import (
    WEIGHTS_PATH,
    HoldBody,
    UploadResponse,
    WeightInfo,
    WeightSpec,
    error_json,
)
from ..errors import (
    BadRequest,
    Forbidden,
    GateError,
    InvalidBody,
    MethodNotAllowed,
    RolloutNotFound,
    TooLarge,
    WeightPushError,
)
from ..gate import Gate
from ..transfer import PUSH_PREFIX, SHM_DIR, check_push_file, engine_spec
from ._asgi import App, Message, Receive, Scope, Send, read_body, send_body
from ._control import ControlPlane
from ._route_table import GUARDED_PATHS, normalized_path, rule_of
from ._served_weights import ServedWeights

__all__ = ["GUARDED_PATHS", "MAX_PENDING_UPLOADS", "GuardedRoutes", "guarded_path"]

MAX_PENDING_UPLOADS: Final = 2
"""Uploads waiting for their push's finish (two pushes in flight); a newer one removes the
oldest."""
_LABELS: Final = {
    "/finish_weight_update": "weight_version",
    "/update_weight_version": "new_version",
}
_MAX_ROUTE_BODY: Final = 16 << 20
_log = logging.getLogger("tokcap_vllm.gate")


def guarded_path(scope: Scope) -> str | None:
    """The route a request names, if the route table guards or refuses it by name, or it is
    a tokcap weight route (None otherwise: the request is routed first, then an unlisted
    plain path is guarded too, see `GuardedRoutes`)."""
    path = normalized_path(scope["path"], scope.get("root_path") or "")
    if path == WEIGHTS_PATH or path.startswith(WEIGHTS_PATH + "/"):
        return path
    rule = rule_of(path)
    return path if rule.listed and rule.access != "public" else None


class GuardedRoutes:
    """ASGI handler for every route that is not public and ``/tokcap/v1/weights``; watches
    the weight routes."""

    def __init__(self, gate: Gate, control: ControlPlane, *, upload_dir: str = SHM_DIR) -> None:
        self.gate = gate
        self.control = control
        self.weights = ServedWeights(version=gate.config.weight_version)
        self.upload_dir = upload_dir
        self._uploads: list[str] = []
        self._updated = False
        self._watching = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        path = normalized_path(scope["path"], scope.get("root_path") or "")
        try:
            self.control.authorize(scope)
            if rule_of(path).access == "refused":
                raise Forbidden("route_refused", f"{path} is refused: {rule_of(path).reason}")
            self._watch()
            if path == WEIGHTS_PATH or path.startswith(WEIGHTS_PATH + "/"):
                status, body = await self._tokcap(path, scope, receive)
                await send_body(send, status, body)
                return
            receive = await self._admit(path, scope, receive)
        except GateError as e:
            status = type(e).status
            headers = [(b"www-authenticate", b"Bearer")] if status == 401 else []
            await send_body(send, status, error_json(e.code, e.message, status), headers=headers)
            return
        await self._vllm(path, scope, receive, send, app)

    def _watch(self) -> None:
        """Let the gate read this tracker (once; only when weight routes are in use, so an
        in-process `WeightSync` watched by the gate stays in charge otherwise)."""
        if not self._watching:
            self.gate.watch_weights(self.weights)  # type: ignore[arg-type]
            self._watching = True

    # ---- vLLM's routes, asked about, then watched --------------------------------------

    async def _admit(self, path: str, scope: Scope, receive: Receive) -> Receive:
        """Refuse what the rules refuse before vLLM sees it (see the module); the body, if
        it was read, is handed to vLLM again."""
        if path not in _LABELS and path != "/update_weights":
            return receive
        body = await read_body(receive, _MAX_ROUTE_BODY)
        try:
            fields = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError):
            fields = None  # vLLM answers for a body that is not JSON; nothing is labelled
        if isinstance(fields, dict):
            try:
                if path in _LABELS and fields.get(_LABELS[path]) is not None:
                    self.weights.check_label(fields[_LABELS[path]])
                elif path == "/update_weights":
                    await self._check_file(scope, fields.get("update_info"))
            except WeightPushError as e:
                if path == "/update_weights":
                    self.weights.failed("update_failed")
                raise InvalidBody(e.code, e.message) from e
        sent = False

        async def again() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return again

    async def _check_file(self, scope: Scope, info: object) -> None:
        """The push file an ``/update_weights`` names, as the worker will check it."""
        if not isinstance(info, dict) or "path" not in info:
            return  # another backend's update (nccl, ipc): nothing on this host to check
        path, entries = info.get("path"), info.get("entries", [])
        if not isinstance(path, str) or not isinstance(entries, list):
            raise WeightPushError("bad_entry", "update_info is {path: str, entries: [...]}")
        spec = {name: (d, tuple(shape)) for name, (d, shape) in _spec_of(scope).tensors.items()}
        await anyio.to_thread.run_sync(check_push_file, path, entries, spec)

    async def _vllm(self, path: str, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        """Run vLLM's route; the tracker moves *before* the answer leaves, so a client's next
        route (sent as soon as it reads this answer) always sees this one's effect."""
        observed = False

        async def observe(status: int) -> None:
            nonlocal observed
            if not observed:
                observed = True
                with anyio.CancelScope(shield=True):
                    await self._observe(path, 200 <= status < 300, scope)

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                await observe(int(message["status"]))
            await send(message)

        try:
            await app(scope, receive, watched)
        except Exception as e:  # vLLM's weight routes raise on a failed RPC: answer for it here
            if observed:
                raise
            _log.exception("tokcap gate: %s failed", path)
            await observe(500)
            message = f"{path} failed: {type(e).__name__}: {e}"[:2000]
            await send_body(send, 500, error_json("engine_route_failed", message, 500))
        finally:
            await observe(0)  # cancelled or ended without an answer: counts as failed

    async def _observe(self, path: str, ok: bool, scope: Scope) -> None:
        weights = self.weights
        if path == "/reset_prefix_cache":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if ok and query.get("reset_running_requests") == ["true"]:
                weights.recomputed()
        elif path == "/update_weights":
            self._updated = self._updated or ok
            weights.updated() if ok else weights.failed("update_failed")
        elif path in ("/sleep", "/wake_up"):
            if ok:
                await self._observe_sleep(path, scope)
        elif path in ("/start_weight_update", "/finish_weight_update", "/update_weight_version"):
            if path == "/start_weight_update":
                self._updated = False
            elif path == "/finish_weight_update" and self._updated:  # not an empty finish
                self._remove_uploads()
            if not ok:
                if path != "/update_weight_version":
                    weights.failed(path.strip("/").removesuffix("_weight_update") + "_failed")
                return
            label = await _engine_label(scope)
            if path == "/start_weight_update":
                weights.started(label)
            elif path == "/finish_weight_update":
                weights.finished(label)
            else:
                weights.labelled(label)

    async def _observe_sleep(self, path: str, scope: Scope) -> None:
        if not await scope["app"].state.engine_client.is_sleeping():
            self.weights.woke()
        elif path == "/sleep":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            level = (query.get("level") or ["1"])[0]
            self.weights.slept(int(level) if level.isdigit() else 1)

    # ---- tokcap's weight routes ------------------------------------------------------

    async def _tokcap(self, path: str, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        action = path[len(WEIGHTS_PATH) :].strip("/")
        method = scope.get("method", "GET")
        if action == "":
            _allow(method, "GET")
            return 200, msgspec.json.encode(await self.info(scope))
        if action == "spec":
            _allow(method, "GET")
            return 200, msgspec.json.encode(_spec_of(scope))
        if action == "hold":
            _allow(method, "POST")
            body = await read_body(receive, 1 << 16)
            try:
                reason = msgspec.json.decode(body, type=HoldBody).reason
            except msgspec.MsgspecError as e:
                raise InvalidBody("bad_body", f"invalid body: {e}") from e
            self.weights.hold(reason)
            return 200, msgspec.json.encode(await self.info(scope))
        if action == "release":
            _allow(method, "POST")
            self.weights.release()
            return 200, msgspec.json.encode(await self.info(scope))
        if action == "upload":
            _allow(method, "PUT")
            return 200, msgspec.json.encode(await self._upload(scope, receive))
        raise RolloutNotFound("unknown_route", f"no weight route {path}")

    async def info(self, scope: Scope) -> WeightInfo:
        """The gate's weight state and the engine's label."""
        state = self.weights.state
        return WeightInfo(
            phase=state.phase.name,
            version=state.version,
            engine_phase=self.weights.engine_phase,
            held=self.weights.held,
            error=state.error,
            engine_version=await _engine_label(scope),
        )

    async def _upload(self, scope: Scope, receive: Receive) -> UploadResponse:
        limit = sum(_nbytes(dtype, shape) + 64 for dtype, shape in _spec_of(scope).tensors.values())
        while len(self._uploads) >= MAX_PENDING_UPLOADS:  # bounded: the oldest goes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._uploads.pop(0))
        fd, path = tempfile.mkstemp(dir=self.upload_dir, prefix=PUSH_PREFIX)
        self._uploads.append(path)
        size = 0
        with os.fdopen(fd, "wb") as f:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self._remove_uploads()
                    raise BadRequest("client_disconnected", "the client went away while sending")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    self._remove_uploads()
                    raise TooLarge("upload_too_large", f"a push is at most {limit} bytes")
                if chunk:
                    await anyio.to_thread.run_sync(f.write, chunk)
                if not message.get("more_body", False):
                    break
        return UploadResponse(path=path, nbytes=size)

    def _remove_uploads(self) -> None:
        for path in self._uploads:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._uploads.clear()


async def _engine_label(scope: Scope) -> str:
    label = await scope["app"].state.engine_client.get_weight_version()
    return str(label)


def _spec_of(scope: Scope) -> WeightSpec:
    state: Any = scope["app"].state
    cached: WeightSpec | None = getattr(state, "tokcap_weight_spec", None)
    if cached is None:
        spec, tied = engine_spec(state.engine_client.model_config)
        cached = WeightSpec(
            tensors={name: (dtype, list(shape)) for name, (dtype, shape) in spec.items()},
            tied=list(tied),
        )
        state.tokcap_weight_spec = cached
    return cached


def _nbytes(dtype: str, shape: list[int]) -> int:
    import torch

    numel = 1
    for n in shape:
        numel *= n
    itemsize: int = getattr(torch, dtype).itemsize
    return numel * itemsize


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise MethodNotAllowed("method_not_allowed", f"use {allowed}")
