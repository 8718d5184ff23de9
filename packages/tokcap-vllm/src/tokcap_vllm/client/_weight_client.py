"""`GateWeightClient`: a trainer in another process pushes a full state dict to one gate.

Everything goes through vLLM's own weight-transfer routes (served with
``VLLM_SERVER_DEV_MODE=1``, engine started with ``--weight-transfer-config
'{"backend": "tokcap_shm"}'``) plus tokcap's ``/tokcap/v1/weights`` routes, every request
with the gate's bearer token (vLLM's own HTTP weight-sync client sends no headers). A push:

1. **check** (nothing sent): the state dict must be exactly the gate's spec
   (``GET /tokcap/v1/weights/spec``): every name, each shape, the engine's dtype, finite
   values, tied pairs equal (`check_push`); and ``version`` above the gate's. Else
   `WeightPushError`, and the gate never saw it.
2. **stage** (the engine keeps serving): ``transport="shm"`` writes the push file into
   shared memory on this host (the gate's host): one file per client, rewritten in place
   push after push (`tokcap_vllm.transfer._shm.PushFile`; removed by `aclose`); ``"http"`` streams
   the same bytes to the gate (``PUT /tokcap/v1/weights/upload``), which writes the file
   on its host. A failure
   here loads nothing: `WeightSyncError` ``stage_failed``.
3. **swap**: ``POST /pause?mode=...`` (vLLM defaults to ``abort``; tokcap's push ``mode``
   defaults to ``wait``: in-flight calls finish on the old weights; ``recompute`` and
   ``keep`` freeze them in place, see `tokcap_vllm.WeightSync`), ``/start_weight_update``
   (if it fails, one empty ``/finish_weight_update`` clears the flag a failed finish leaves
   set in vLLM's worker, then start again), ``/update_weights`` with ``{"path", "entries"}`` (JSON:
   the bytes travel by reference), ``/finish_weight_update`` with the version (vLLM then
   labels outputs with it), ``/reset_prefix_cache?reset_running_requests=true`` (vLLM's
   finish does not: cached KV of the old weights gave measured errors; skipped in mode
   ``keep``, where calls in flight keep their KV and the gate salts new prompts by
   version instead), ``/reset_encoder_cache`` (every mode: an image's encoder output is
   the old weights', and vLLM's finish keeps it), ``/resume``, and last
   ``/tokcap/v1/weights/release`` (lifts a hold; ``release=False`` leaves that to a fleet).

A failure in 3 raises `WeightSyncError` ``<step>_failed``. Before the weights were touched
(pause, start) the engine is resumed; after, it stays paused and the gate, which watched
the failing route, refuses captured calls (503 ``weights_unavailable``) until a full push
succeeds. A failed prefix- or encoder-cache reset, which the gate cannot see, is turned
into a hold.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import httpx
import msgspec

from ..api import WEIGHTS_PATH, UploadResponse, WeightInfo, WeightSpec
from ..errors import WeightPushError, WeightSyncError
from ..transfer import (
    PUSH_MODES,
    SHM_DIR,
    Entry,
    PushFile,
    PushMode,
    TensorSpec,
    check_push,
    check_version,
    entries_for,
    file_chunks,
    next_version,
    refuse_non_finite,
    resets_running_kv,
    vllm_pause_mode,
)
from ._http import AsyncClosing, bearer_http

if TYPE_CHECKING:
    import torch

__all__ = ["GateWeightClient", "PushTransport", "StagedPush", "check_while_staging"]

PushTransport = Literal["shm", "http"]
_MODES = PUSH_MODES


@dataclass(frozen=True, slots=True)
class StagedPush:
    """A push file ready on the gate's host: what ``/update_weights`` names."""

    path: str
    entries: list[Entry]
    owned_here: bool
    """True when this process wrote the file (its client's `PushFile`, kept for the next
    push); False for an upload (the gate removes it)."""


class GateWeightClient(AsyncClosing):
    """Full-state-dict pushes into one served gate's engine; ``async with`` it, or `aclose`.

    ``token`` goes only into the ``authorization`` header. One push at a time per client.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        transport: PushTransport = "shm",
        mode: PushMode = "wait",
        check_finite: bool = True,
        shm_dir: str = SHM_DIR,
        timeout_s: float = 600.0,
        http: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if transport not in ("shm", "http"):
            raise WeightPushError("bad_transport", f"transport is 'shm' or 'http': {transport!r}")
        if mode not in _MODES:
            raise WeightPushError("bad_mode", f"mode is one of {_MODES}: {mode!r}")
        self.base_url = base_url.rstrip("/")
        self.transport: PushTransport = transport
        self.mode: PushMode = mode
        self.check_finite = check_finite
        self.shm_dir = shm_dir
        self._http = bearer_http(self.base_url, token, timeout_s, http)
        self._file = PushFile(shm_dir)
        self._spec: tuple[dict[str, TensorSpec], tuple[tuple[str, str], ...]] | None = None

    def __repr__(self) -> str:
        return f"GateWeightClient({self.base_url!r}, transport={self.transport!r})"

    async def aclose(self) -> None:
        """Close the HTTP connections; remove the push file."""
        self._file.remove()
        await self._http.aclose()

    # ---- reading ---------------------------------------------------------------------

    async def info(self) -> WeightInfo:
        """The gate's weight state and the engine's version label."""
        response = await self._call("info", "GET", WEIGHTS_PATH)
        return msgspec.json.decode(response.content, type=WeightInfo)

    async def spec(self) -> tuple[dict[str, TensorSpec], tuple[tuple[str, str], ...]]:
        """What a push must carry, and the tied pairs (asked once, then kept)."""
        if self._spec is None:
            response = await self._call("spec", "GET", WEIGHTS_PATH + "/spec")
            raw = msgspec.json.decode(response.content, type=WeightSpec)
            spec = {name: (dtype, tuple(shape)) for name, (dtype, shape) in raw.tensors.items()}
            self._spec = spec, tuple(raw.tied)
        return self._spec

    # ---- pushing ---------------------------------------------------------------------

    async def check(self, weights: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Step 1 (in a worker thread): ``weights`` as contiguous CPU tensors, or
        `WeightPushError`."""
        spec, tied = await self.spec()
        return await anyio.to_thread.run_sync(
            functools.partial(check_push, weights, spec, tied=tied, check_finite=self.check_finite)
        )

    async def stage(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> StagedPush:
        """Step 2: put the bytes on the gate's host (`WeightSyncError` ``stage_failed``)."""
        try:
            if self.transport == "shm":
                path, entries = await anyio.to_thread.run_sync(self._file.write, tensors)
                return StagedPush(path, entries, owned_here=True)
            entries, _ = entries_for(tensors)
            response = await self._call(
                "stage", "PUT", WEIGHTS_PATH + "/upload", content=_stream(tensors, entries)
            )
            upload = msgspec.json.decode(response.content, type=UploadResponse)
            return StagedPush(upload.path, entries, owned_here=False)
        except WeightSyncError:
            raise
        except (OSError, httpx.HTTPError) as e:
            raise WeightSyncError("stage_failed", str(e)) from e

    async def push(
        self, weights: Mapping[str, torch.Tensor], version: int, *, release: bool = True
    ) -> WeightInfo:
        """Load ``weights`` (the full state dict) into the gate's engine as ``version``.

        Returns the gate's `WeightInfo` afterwards. Raises `WeightPushError` before anything
        was sent, or `WeightSyncError`. Do not modify the tensors until it returns.
        """
        await self.check_version(version)
        await self.swap(await self.check_and_stage(weights), version)
        return await (self.release() if release else self.info())

    async def check_and_stage(self, weights: Mapping[str, torch.Tensor]) -> StagedPush:
        """Steps 1 and 2; with ``transport="shm"`` the finite-values check runs while the
        push file is written (the file is this client's: the gate sees nothing of a push
        refused here)."""
        if self.transport != "shm" or not self.check_finite:
            return await self.stage(await self.check(weights))
        spec, tied = await self.spec()
        tensors = await anyio.to_thread.run_sync(
            functools.partial(check_push, weights, spec, tied=tied, check_finite=False)
        )
        return await check_while_staging(tensors, self.stage)

    async def check_version(self, version: int) -> None:
        """`WeightPushError` unless ``version`` is a weight version above the gate's
        (`tokcap_vllm.transfer.next_version`: ``bad_version``, ``version_not_increasing``)."""
        check_version(version)  # before asking the gate anything
        next_version((await self.info()).version, version)

    async def swap(self, staged: StagedPush, version: int) -> None:
        """Step 3: pause, load ``staged`` through vLLM's routes, label, reset, resume."""
        step = "pause"
        try:
            await self._call(step, "POST", "/pause", params=self._pause_params())
            step = "start"
            await self._start()
            step = "update"
            update = {"update_info": {"path": staged.path, "entries": staged.entries}}
            await self._call(step, "POST", "/update_weights", json=update)
            step = "finish"
            await self._call(
                step, "POST", "/finish_weight_update", json={"weight_version": str(version)}
            )
            for step, run in self._after_load():
                await run(step)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await self._after_failure(step, version)
            if isinstance(e, WeightSyncError):
                raise
            if isinstance(e, Exception):
                raise WeightSyncError(f"{step}_failed", str(e)) from e
            raise

    @asynccontextmanager
    async def external_update(self, version: int, *, release: bool = True) -> AsyncIterator[None]:
        """Steps 3's pause before, and label, prefix- and encoder-cache resets, resume (and
        release) after, a push that another engine drives through vLLM's routes: vLLM's
        ``nccl`` or ``ipc`` trainer engines on GPU, or any `WeightTransferTrainerFactory`
        engine, with `tokcap_vllm.transfer.BearerWeightSyncClient` (run its blocking
        ``send_weights`` in a thread). A failure inside, or after, holds the gate until a
        push releases it.
        """
        await self.check_version(version)
        await self._call("pause", "POST", "/pause", params=self._pause_params())
        try:
            yield
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._after_failure("prefix_cache", version)
            raise
        step = "label"
        try:
            label = {"new_version": str(version)}
            await self._call(step, "POST", "/update_weight_version", json=label)
            for step, run in self._after_load():
                await run(step)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._after_failure("prefix_cache", version)
            raise
        if release:
            await self.release()

    def _after_load(self) -> tuple[tuple[str, Callable[[str], Awaitable[None]]], ...]:
        """What every weight change ends with, in order, each step with the name its errors
        carry: the prefix-cache reset, the encoder-cache reset, resume."""
        return (
            ("prefix_cache", self._reset_kv),
            ("encoder_cache", self._reset_encoder),
            ("resume", self._resume),
        )

    async def _resume(self, step: str) -> None:
        await self._call(step, "POST", "/resume")

    def _pause_params(self) -> dict[str, str]:
        return {"mode": vllm_pause_mode(self.mode), "clear_cache": "false"}

    async def _reset_kv(self, step: str) -> None:
        """Reset the prefix cache and the KV of running requests (not in mode ``keep``)."""
        if not resets_running_kv(self.mode):
            return
        reset = await self._call(
            step, "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}
        )
        if not reset.json().get("success"):
            raise WeightSyncError("prefix_cache_failed", "the engine kept its prefix cache")

    async def _reset_encoder(self, step: str) -> None:
        """Drop the engine's encoder outputs (every mode): an image's was computed by the old
        weights, and vLLM's weight-transfer finish keeps them (reused, they would be inexact)."""
        await self._call(step, "POST", "/reset_encoder_cache")

    async def _start(self) -> None:
        try:
            await self._call("start", "POST", "/start_weight_update")
        except WeightSyncError:  # maybe a flag left set by a failed finish: clear it, retry once
            with contextlib.suppress(WeightSyncError):
                await self._call("start", "POST", "/finish_weight_update")
            await self._call("start", "POST", "/start_weight_update")

    async def _after_failure(self, step: str, version: int) -> None:
        """Best effort: resume an untouched engine; hold a gate that cannot see the failure."""
        try:
            if step in ("pause", "start"):
                await self._call("resume", "POST", "/resume")
            elif step in ("prefix_cache", "encoder_cache", "resume"):
                await self.hold(f"push of version {version} failed at {step}")
        except WeightSyncError:
            pass

    async def hold(self, reason: str) -> WeightInfo:
        """Make the gate refuse captured calls until `release` (or a push with release)."""
        response = await self._call("hold", "POST", WEIGHTS_PATH + "/hold", json={"reason": reason})
        return msgspec.json.decode(response.content, type=WeightInfo)

    async def release(self) -> WeightInfo:
        """Lift a hold (`WeightSyncError` ``release_failed`` unless the engine is READY)."""
        response = await self._call("release", "POST", WEIGHTS_PATH + "/release")
        return msgspec.json.decode(response.content, type=WeightInfo)

    async def _call(self, step: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{step}_failed", f"{method} {path}: {e!r}") from e
        if response.status_code >= 300:
            raise WeightSyncError(
                f"{step}_failed",
                f"{method} {path}: HTTP {response.status_code} {response.text[:300]}",
            )
        return response


async def check_while_staging(
    tensors: Sequence[tuple[str, torch.Tensor]],
    stage: Callable[[Sequence[tuple[str, torch.Tensor]]], Awaitable[StagedPush]],
) -> StagedPush:
    """``stage(tensors)`` while `refuse_non_finite` reads them in another thread (both
    release the GIL); the check's refusal wins over a staging failure."""
    staged: list[StagedPush] = []
    failures: list[WeightSyncError] = []

    async def write() -> None:
        try:
            staged.append(await stage(tensors))
        except WeightSyncError as e:
            failures.append(e)

    refusal: WeightPushError | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(write)
        try:
            await anyio.to_thread.run_sync(refuse_non_finite, tensors)
        except WeightPushError as e:
            refusal = e
    if refusal is not None:
        raise refusal
    if failures:
        raise failures[0]
    return staged[0]


async def _stream(
    tensors: Sequence[tuple[str, torch.Tensor]], entries: Sequence[Entry]
) -> AsyncIterator[bytes]:
    for chunk in file_chunks(tensors, entries):
        view = memoryview(chunk)
        for start in range(0, len(view), 4 << 20):
            yield bytes(view[start : start + (4 << 20)])
