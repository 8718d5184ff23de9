"""`ControlPlaneClient`: the trainer's async client for a gate's control plane (httpx, anyio).

Retries: GET and DELETE are idempotent and retried with exponential backoff on transport
errors and 5xx answers. POST close/terminal are not idempotent (a second close answers
409 ``rollout_closed``), so they are retried only when the request provably never left
(connection refused or connect timeout). A retried DELETE that finds the rollout gone
(404) counts as released.

`fetch_receipts` fetches manifests concurrently (bounded), replays and verifies them with
the core against the heads kept at close, and returns one receipt per rollout id, in
order. A rollout the gate does not know, or whose manifest does not decode or verify,
becomes a *poisoned* receipt whose reason is ``manifest_invalid:<code>`` (never dropped);
failures of the control plane itself (auth, unreachable) raise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import anyio
import attrs
import httpx
import msgspec

from tokcap_core import Manifest, Receipt, decode_manifest
from tokcap_core.errors import ManifestError
from tokcap_core.ids import validate_rollout_id
from tokcap_core.ledger import MAX_MANIFEST_BYTES

from ..api import (
    CONTROL_PREFIX,
    MAX_CLOSE_BATCH,
    CloseBody,
    CloseManyBody,
    CloseManyResponse,
    CloseOutcome,
    ErrorBody,
    HeadResponse,
    Health,
    OpenResponse,
    RolloutItem,
    RolloutPage,
    TerminalBody,
    WitnessBody,
)
from ..errors import (
    ControlNotFound,
    ControlPlaneError,
    ControlRequestError,
    ControlUnreachable,
)
from ._closes import (
    CloseResult,
    RolloutClose,
    manifest_failure,
    release_all,
    verified_receipt,
)
from ._http import AsyncClosing, bearer_http

__all__ = ["ControlPlaneClient"]


_RESPONSE_LIMIT = 64 * 1024 * 1024


def _error(status: int, body: bytes, what: str) -> ControlPlaneError:
    try:
        detail = msgspec.json.decode(body, type=ErrorBody).error
        code, message = detail.code, detail.message.removeprefix(f"[{detail.code}] ")
    except msgspec.MsgspecError:
        code, message = f"http_{status}", f"{what}: HTTP {status}"
    return ControlPlaneError.of_status(status, code, message)


class ControlPlaneClient(AsyncClosing):
    """Typed async client of ``/tokcap/v1``; use as ``async with ControlPlaneClient(...) as c``.

    ``token`` goes into the ``authorization`` header only (never into ``repr`` or errors).
    ``max_manifest_bytes`` is enforced on the wire, before any parsing. ``owner`` (sent as
    ``X-Tokcap-Owner`` on every request) makes the rollouts this client opens its own: the
    gate refuses other owners' opens, closes and releases of them (``rollout_owned``,
    `tokcap_vllm.gate._rollouts.Owners`).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        max_concurrency: int = 16,
        transport: httpx.AsyncBaseTransport | None = None,
        owner: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.owner = owner
        self.instance = ""
        """The gate instance that answered last (``X-Tokcap-Gate-Instance``)."""
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_manifest_bytes = max_manifest_bytes
        self.max_concurrency = max_concurrency
        self._http = bearer_http(self.base_url + CONTROL_PREFIX, token, timeout_s, transport)
        if owner is not None:
            self._http.headers["x-tokcap-owner"] = owner

    def __repr__(self) -> str:
        return f"ControlPlaneClient({self.base_url!r})"

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    # ---- routes ------------------------------------------------------------------------

    async def health(self) -> Health:
        """``GET /health``."""
        return msgspec.json.decode(await self._get("health"), type=Health)

    async def metrics(self) -> str:
        """``GET /metrics``: the gate's Prometheus text."""
        return (await self._get("metrics")).decode("utf-8")

    async def rollouts(
        self, state: Literal["open", "closed"] | None = None, *, page_size: int | None = None
    ) -> list[RolloutItem]:
        """Every rollout the gate holds (in ``state``), following the pages."""
        items: list[RolloutItem] = []
        after: str | None = None
        while True:
            params = {
                k: v
                for k, v in (("state", state), ("limit", page_size), ("after", after))
                if v is not None
            }
            page = msgspec.json.decode(await self._get("rollouts", params), type=RolloutPage)
            items.extend(page.rollouts)
            if page.next_cursor is None:
                return items
            after = page.next_cursor

    async def manifest_bytes(self, rollout_id: str) -> bytes:
        """The manifest as the gate encoded it; `ManifestError` ``too_large`` over the bound."""
        return await self._get(_path(rollout_id, "manifest"), limit=self.max_manifest_bytes)

    async def manifest(self, rollout_id: str) -> Manifest:
        """The decoded (not yet verified) manifest of ``rollout_id``."""
        data = await self.manifest_bytes(rollout_id)
        return decode_manifest(data, max_bytes=self.max_manifest_bytes)

    async def open(self, rollout_id: str) -> OpenResponse:
        """Open ``rollout_id`` on this gate before its first call (a gate run with
        ``--tokcap-require-open`` refuses calls of rollouts nobody opened); opening an open
        rollout again is a no-op, so it is retried like a GET. The answer names the gate's
        instance (a restarted gate has a new one)."""
        data = await self._send("POST", _path(rollout_id, "open"), body=b"{}", idempotent=True)
        return msgspec.json.decode(data, type=OpenResponse)

    async def declare_terminal(
        self, rollout_id: str, *, call_id: str | None = None, response_id: str | None = None
    ) -> tuple[int, str]:
        """Name the terminal call (exactly one of the two); returns the ledger head."""
        if (call_id is None) == (response_id is None):
            raise ValueError("give exactly one of call_id, response_id")
        body = TerminalBody(call_id=call_id, response_id=response_id)
        return await self._post_head(_path(rollout_id, "terminal"), body)

    async def close(
        self,
        rollout_id: str,
        *,
        reward: float | None = None,
        response_id: str | None = None,
        content: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        content_fingerprint: str | None = None,
    ) -> tuple[int, str]:
        """Close the rollout with its reward and witnesses; returns the durable ledger head.

        Keep the head and pass it to `fetch_receipts` (``expected_heads``). Closing twice
        raises `ControlConflict` (``rollout_closed``).
        """
        witnesses = WitnessBody(
            response_id=response_id,
            content=content,
            tool_calls=tool_calls,
            content_fingerprint=content_fingerprint,
        )
        body = CloseBody(reward=reward, witnesses=witnesses)
        return await self._post_head(_path(rollout_id, "close"), body)

    async def close_many(
        self,
        closes: Sequence[RolloutClose],
        *,
        receipts: Literal["terminal", "all"] | None = None,
    ) -> list[CloseResult]:
        """Close many rollouts with ONE durable ledger write on the gate (group commit).

        Returns one `CloseResult` per rollout, in order: its durable head, or the typed
        error its own `close` would have raised (`ControlNotFound`, `ControlConflict`,
        `ControlUnreachable` ``ledger_sync_failed``, ...). If the batch itself gets no
        answer (the gate is unreachable after the request left), every rollout's result
        holds that `ControlUnreachable`: whether each closed is then unknown, as for a
        single close. Auth failures raise. Batches over `MAX_CLOSE_BATCH` are sent in parts.

        ``receipts`` (the segments, as in `fetch_receipts`): each closed rollout's result
        also holds its receipt, verified against its head exactly as `fetch_receipts`
        would, from the manifest the close answered with (one fetch for a manifest the gate
        left out); control-plane failures of such a fetch raise.
        """
        ids = [validate_rollout_id(c.rollout_id) for c in closes]
        if len(set(ids)) != len(ids):
            raise ValueError("a rollout id is listed more than once")
        out: list[CloseResult] = []
        for start in range(0, len(closes), MAX_CLOSE_BATCH):
            part = closes[start : start + MAX_CLOSE_BATCH]
            body = CloseManyBody(rollouts=[c.wire() for c in part], manifests=receipts is not None)
            try:
                data = await self._send(
                    "POST", "close", idempotent=False, body=msgspec.json.encode(body)
                )
            except ControlUnreachable as e:
                out.extend(CloseResult(rollout_id=c.rollout_id, error=e) for c in part)
                continue
            answer = msgspec.json.decode(data, type=CloseManyResponse)
            out.extend(self._with_receipt(outcome, receipts) for outcome in answer.results)
        if receipts is not None:
            await self._fetch_left_out(out, receipts)
        return out

    def _with_receipt(
        self, outcome: CloseOutcome, segments: Literal["terminal", "all"] | None
    ) -> CloseResult:
        result = CloseResult.of(outcome)
        if segments is None or result.head is None or not outcome.manifest:
            return result
        receipt = verified_receipt(
            result.rollout_id,
            bytes(outcome.manifest),
            expected_head=result.head,
            segments=segments,
            max_bytes=self.max_manifest_bytes,
        )
        return attrs.evolve(result, receipt=receipt)

    async def _fetch_left_out(
        self, results: list[CloseResult], segments: Literal["terminal", "all"]
    ) -> None:
        """Fetch the receipts of closed rollouts whose manifest the close left out."""
        left = {i: r for i, r in enumerate(results) if r.head is not None and r.receipt is None}
        if not left:
            return
        heads = {r.rollout_id: r.head_or_raise() for r in left.values()}
        fetched = await self.fetch_receipts(list(heads), expected_heads=heads, segments=segments)
        for (index, result), receipt in zip(left.items(), fetched, strict=True):
            results[index] = attrs.evolve(result, receipt=receipt)

    async def release_many(self, rollout_ids: Iterable[str]) -> None:
        """`release` every rollout, concurrently (``max_concurrency``); the first error raises
        once all have been tried."""
        await release_all(self.release, rollout_ids, self.max_concurrency)

    async def release(self, rollout_id: str) -> None:
        """Make the gate forget a closed rollout (its sink keys are the caller's to clear)."""
        await self._send("DELETE", _path(rollout_id), idempotent=True, gone_ok=True)

    # ---- receipts ----------------------------------------------------------------------

    async def receipt(
        self,
        rollout_id: str,
        *,
        expected_head: tuple[int, str] | None = None,
        segments: Literal["terminal", "all"] = "terminal",
    ) -> Receipt:
        """Fetch, verify and assemble one rollout's receipt (poisoned if the manifest fails)."""
        validate_rollout_id(rollout_id)
        try:
            data = await self.manifest_bytes(rollout_id)
        except (ControlNotFound, ManifestError) as e:
            return manifest_failure(rollout_id, e.code)
        except ControlRequestError as e:
            if e.status != 413:
                raise
            return manifest_failure(rollout_id, e.code)
        return verified_receipt(
            rollout_id,
            data,
            expected_head=expected_head,
            segments=segments,
            max_bytes=self.max_manifest_bytes,
        )

    async def fetch_receipts(
        self,
        rollout_ids: Iterable[str],
        *,
        expected_heads: Mapping[str, tuple[int, str]] | None = None,
        segments: Literal["terminal", "all"] = "terminal",
    ) -> list[Receipt]:
        """One receipt per id, in order: manifests fetched concurrently (``max_concurrency``).

        Poisoned receipts are included, with reasons; control-plane failures (auth,
        unreachable after retries) raise the first `ControlPlaneError`.
        """
        ids = [validate_rollout_id(r) for r in rollout_ids]
        heads = dict(expected_heads or {})
        out: list[Receipt | None] = [None] * len(ids)
        errors: list[ControlPlaneError] = []
        limiter = anyio.CapacityLimiter(self.max_concurrency)

        async def one(index: int, rollout_id: str) -> None:
            async with limiter:
                try:
                    out[index] = await self.receipt(
                        rollout_id, expected_head=heads.get(rollout_id), segments=segments
                    )
                except ControlPlaneError as e:
                    errors.append(e)
                    tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, rollout_id in enumerate(ids):
                tg.start_soon(one, index, rollout_id)
        if errors:
            raise errors[0]
        return [r for r in out if r is not None]

    # ---- transport ---------------------------------------------------------------------

    async def _get(
        self, path: str, params: Mapping[str, Any] | None = None, *, limit: int = _RESPONSE_LIMIT
    ) -> bytes:
        return await self._send("GET", path, params=params, idempotent=True, limit=limit)

    async def _post_head(self, path: str, body: msgspec.Struct) -> tuple[int, str]:
        data = await self._send("POST", path, body=msgspec.json.encode(body), idempotent=False)
        head = msgspec.json.decode(data, type=HeadResponse).head
        return head.seq, head.hash

    async def _send(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool,
        params: Mapping[str, Any] | None = None,
        body: bytes | None = None,
        limit: int = _RESPONSE_LIMIT,
        gone_ok: bool = False,
    ) -> bytes:
        """One call with its retries; ``gone_ok``: a 404 after a retry means the first took."""
        what = f"{method} {CONTROL_PREFIX}{path}"
        attempt = 0
        while True:
            try:
                status, data = await self._once(method, path, params, body, limit)
            except httpx.TransportError as e:
                never_sent = isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                if attempt < self.retries and (idempotent or never_sent):
                    attempt += 1
                    await anyio.sleep(self.backoff_s * 2 ** (attempt - 1))
                    continue
                raise ControlUnreachable(
                    "unreachable", f"{what}: {type(e).__name__} after {attempt + 1} attempt(s)"
                ) from e
            if status >= 500 and idempotent and attempt < self.retries:
                attempt += 1
                await anyio.sleep(self.backoff_s * 2 ** (attempt - 1))
                continue
            if status == 404 and gone_ok and attempt > 0:
                return b""
            if status >= 400:
                raise _error(status, data, what)
            return data

    async def _once(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None,
        body: bytes | None,
        limit: int,
    ) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"} if body is not None else None
        async with self._http.stream(
            method, path, params=params, content=body, headers=headers
        ) as response:
            self.instance = response.headers.get("x-tokcap-gate-instance", self.instance)
            declared = response.headers.get("content-length")
            if response.status_code < 400 and declared is not None and int(declared) > limit:
                raise ManifestError("too_large", f"answer is {declared} bytes, bound is {limit}")
            parts, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise ManifestError("too_large", f"answer is over the bound of {limit} bytes")
                parts.append(chunk)
            return response.status_code, b"".join(parts)


def _path(rollout_id: str, action: str | None = None) -> str:
    validate_rollout_id(rollout_id)  # the grammar has no character that needs quoting
    return f"rollouts/{rollout_id}" + (f"/{action}" if action else "")
