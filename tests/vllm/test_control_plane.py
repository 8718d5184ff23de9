"""The control plane on the real gate, for rollouts the real ``openai`` client made.

Receipts round-trip through `ControlPlaneClient`; every route answers 401 without the
right token and the token never reaches logs, output, ``repr`` or metrics; illegal ledger
transitions answer 409 with the ledger's code; bad bodies 400/422 with a reason code.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import pytest

from tests.vllm._helpers import CONTROL_TOKEN, client, control
from tokcap_core import Receipt, reassemble
from tokcap_core.errors import ManifestError
from tokcap_core.ledger import encode_manifest, manifest_of
from tokcap_vllm import (
    ControlAuthError,
    ControlConflict,
    ControlNotFound,
    ControlPlaneClient,
    ControlRequestError,
    ControlUnreachable,
    InProcessServer,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTROL = "/tokcap/v1"


async def _chat(server: InProcessServer, rollout_id: str, turns: int) -> list[Any]:
    """A short conversation through the rollout's base URL; returns the responses."""
    responses = []
    messages: list[Any] = [{"role": "user", "content": f"hello from {rollout_id}"}]
    async with client(server, rollout_id) as c:
        for turn in range(turns):
            response = await c.chat.completions.create(
                model=server.model, messages=messages, max_tokens=4, temperature=0.0
            )
            responses.append(response)
            messages += [
                {"role": "assistant", "content": response.choices[0].message.content or ""},
                {"role": "user", "content": f"turn {turn}"},
            ]
    return responses


def _encoded(server: InProcessServer, rollout_id: str) -> bytes:
    async def encode() -> bytes:
        return encode_manifest(manifest_of(server.gate.ledger(rollout_id)))

    return server.call(encode)


def _rows(server: InProcessServer, receipt: Receipt) -> list[Any]:
    keys = [c.staging_key for c in receipt.segments[0]]
    staged = server.call(server.gate.sink.get, keys)
    return reassemble(receipt, staged, max_seq_len=1 << 16)


def test_manifests_round_trip_into_verified_receipts(server: InProcessServer) -> None:
    async def main() -> tuple[Any, ...]:
        await _chat(server, "cp-a", turns=3)
        last_b = (await _chat(server, "cp-b", turns=2))[-1]
        async with control(server) as cp:
            head_a = await cp.close("cp-a", reward=1.0)
            head_b = await cp.close(
                "cp-b",
                reward=0.25,
                response_id=last_b.id,
                content=last_b.choices[0].message.content,
            )
            raw = await cp.manifest_bytes("cp-a")
            receipts = await cp.fetch_receipts(
                ["cp-a", "cp-b"], expected_heads={"cp-a": head_a, "cp-b": head_b}
            )
        return head_a, head_b, raw, receipts

    head_a, head_b, raw, (a, b) = anyio.run(main)
    assert raw == _encoded(server, "cp-a")  # exactly encode_manifest bytes
    assert (a.rollout_id, a.status, a.ledger_head, a.reward) == ("cp-a", "verified", head_a, 1.0)
    assert [c.call_id for c in a.segments[0]] == ["c000001", "c000002", "c000003"]
    assert (b.status, b.terminal_selection, b.ledger_head) == ("verified", "response_id", head_b)
    assert b.reward == 0.25
    assert len(_rows(server, a)) == 1


def test_a_wrong_expected_head_or_missing_rollout_is_a_poisoned_receipt(
    server: InProcessServer,
) -> None:
    async def main() -> list[Receipt]:
        await _chat(server, "cp-head", turns=1)
        async with control(server) as cp:
            seq, digest = await cp.close("cp-head", reward=0.0)
            return await cp.fetch_receipts(
                ["cp-head", "cp-never-seen"], expected_heads={"cp-head": (seq - 1, digest)}
            )

    shortened, missing = anyio.run(main)
    assert shortened.failure_reason == "manifest_invalid:unexpected_head"
    assert shortened.sink_keys == ("cp-head/c000001",)  # cleanup still knows what to clear
    assert missing.failure_reason == "manifest_invalid:unknown_rollout"


def test_close_twice_is_a_conflict_and_changes_nothing(server: InProcessServer) -> None:
    async def main() -> tuple[Any, ...]:
        await _chat(server, "cp-twice", turns=1)
        async with control(server) as cp:
            head = await cp.close("cp-twice", reward=1.0)
            with pytest.raises(ControlConflict) as info:
                await cp.close("cp-twice", reward=1.0)
            return head, info.value, await cp.manifest("cp-twice")

    head, error, manifest = anyio.run(main)
    assert (error.status, error.code) == (409, "rollout_closed")
    assert manifest.head == head


def test_a_terminal_naming_no_answered_call_is_refused_and_harms_nothing(
    server: InProcessServer,
) -> None:
    """Q3 (issue #24): a declared terminal that names no call the harness was answered with
    is 422 ``unknown_terminal`` and leaves the rollout as it was (it would poison it for good)."""

    async def main() -> tuple[Any, ...]:
        await _chat(server, "cp-term", turns=2)
        async with control(server) as cp:
            with pytest.raises(ControlRequestError) as unknown:
                await cp.declare_terminal("cp-term", call_id="c000009")
            with pytest.raises(ControlRequestError) as unknown_response:
                await cp.declare_terminal("cp-term", response_id="chatcmpl-nobody")
            await cp.declare_terminal("cp-term", call_id="c000001")
            with pytest.raises(ControlConflict) as again:
                await cp.declare_terminal("cp-term", call_id="c000002")
            head = await cp.close("cp-term", reward=1.0)
            (receipt,) = await cp.fetch_receipts(["cp-term"], expected_heads={"cp-term": head})
        return unknown.value, unknown_response.value, again.value, receipt

    unknown, unknown_response, again, receipt = anyio.run(main)
    assert (unknown.status, unknown.code) == (422, "unknown_terminal")
    assert (unknown_response.status, unknown_response.code) == (422, "unknown_terminal")
    assert (again.status, again.code) == (409, "terminal_already_declared")
    assert (receipt.terminal_call_id, receipt.terminal_selection) == ("c000001", "declared")


def test_bad_bodies_ids_and_methods_get_reason_codes(server: InProcessServer) -> None:
    _settle_chat(server, "cp-bad")
    auth = {"authorization": f"Bearer {CONTROL_TOKEN}"}
    base = f"{server.base_url}{CONTROL}/rollouts"
    cases = [
        ("POST", "/cp-bad/close", b"{not json", 400, "bad_json"),
        ("POST", "/cp-bad/close", b'{"reward": "high"}', 422, "bad_body"),
        ("POST", "/cp-bad/close", b'{"reward": 1, "extra": 2}', 422, "bad_body"),
        ("POST", "/cp-bad/close", b'{"reward": 1e999}', 422, "bad_body"),
        ("POST", "/cp-bad/terminal", b"{}", 422, "bad_body"),
        ("POST", "/cp-bad/terminal", b'{"call_id": "c1", "response_id": "r"}', 422, "bad_body"),
        ("POST", "/cp-bad/terminal", b'{"response_id": "\\u0000"}', 422, "bad_body"),
        ("GET", "/..%2fetc/manifest", None, 400, "bad_rollout_id"),
        ("GET", "/nobody-here/manifest", None, 404, "unknown_rollout"),
        ("POST", "/nobody-here/close", b"{}", 404, "unknown_rollout"),
        ("DELETE", "/cp-bad", None, 409, "rollout_open"),
        ("PUT", "/cp-bad/close", b"{}", 405, "method_not_allowed"),
        ("GET", "/cp-bad/nothing", None, 404, "unknown_route"),
        ("GET", "?state=sideways", None, 422, "bad_query"),
        ("GET", "?limit=0", None, 422, "bad_query"),
    ]
    with httpx.Client(timeout=60, headers=auth) as http:
        for method, tail, body, status, code in cases:
            response = http.request(method, base + tail, content=body)
            assert (response.status_code, response.json()["error"]["code"]) == (status, code), tail
        assert http.get(f"{base}/cp-bad/manifest").status_code == 200  # nothing was changed


def _settle_chat(server: InProcessServer, rollout_id: str) -> None:
    anyio.run(_chat, server, rollout_id, 1)
    server.call(server.gate.drain)


ROUTES = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/rollouts"),
    ("GET", "/rollouts/cp-auth/manifest"),
    ("POST", "/rollouts/cp-auth/terminal"),
    ("POST", "/rollouts/cp-auth/close"),
    ("DELETE", "/rollouts/cp-auth"),
    ("GET", "/no-such-route"),
]


def test_every_control_route_needs_the_token_and_never_leaks_it(
    server: InProcessServer, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    _settle_chat(server, "cp-auth")
    wrong = CONTROL_TOKEN[:-1] + ("x" if CONTROL_TOKEN[-1] != "x" else "y")
    with httpx.Client(timeout=60) as http:
        for method, path in ROUTES:
            url = f"{server.base_url}{CONTROL}{path}"
            for headers in (
                {},
                {"authorization": f"Bearer {wrong}"},
                {"authorization": CONTROL_TOKEN},  # no scheme
                {"authorization": f"Basic {CONTROL_TOKEN}"},
            ):
                response = http.request(method, url, headers=headers, content=b"{}")
                assert response.status_code == 401, (method, path, headers.keys())
                assert response.json()["error"]["code"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
                assert CONTROL_TOKEN not in response.text
        right = {"authorization": f"Bearer {CONTROL_TOKEN}"}
        assert http.get(f"{server.base_url}{CONTROL}/health", headers=right).status_code == 200
        # generation routes stay as vLLM has them: no token needed
        assert http.get(f"{server.base_url}/v1/models").status_code == 200

    async def use_client() -> tuple[str, Any]:
        async with control(server) as cp:
            text = await cp.metrics()
            health = await cp.health()
            await cp.close("cp-auth", reward=1.0)
            await cp.fetch_receipts(["cp-auth"])
            await cp.release("cp-auth")
            assert CONTROL_TOKEN not in repr(cp)
        async with ControlPlaneClient(server.base_url, wrong) as bad:
            with pytest.raises(ControlAuthError) as info:
                await bad.health()
        assert CONTROL_TOKEN not in str(info.value)
        return text, health

    metrics, health = anyio.run(use_client)
    assert health.status == "ok"
    assert health.ledger_file
    for shown in (
        metrics,
        repr(server.gate.config),
        repr(server.gate),
        caplog.text,
        *(r.getMessage() for r in caplog.records),
    ):
        assert CONTROL_TOKEN not in shown
    out, err = capfd.readouterr()
    assert CONTROL_TOKEN not in out
    assert CONTROL_TOKEN not in err


def test_listing_pages_through_open_and_closed_rollouts(server: InProcessServer) -> None:
    async def main() -> tuple[Any, ...]:
        for i in range(3):
            await _chat(server, f"cp-list-{i}", turns=1)
        async with control(server) as cp:
            await cp.close("cp-list-0")
            everything = await cp.rollouts(page_size=1)
            closed = await cp.rollouts("closed", page_size=2)
            opened = await cp.rollouts("open")
        return everything, closed, opened

    everything, closed, opened = anyio.run(main)
    ids = [r.rollout_id for r in everything]
    assert ids == sorted(ids)
    assert {"cp-list-0", "cp-list-1", "cp-list-2"} <= set(ids)
    assert "cp-list-0" in {r.rollout_id for r in closed}
    assert {"cp-list-1", "cp-list-2"} <= {r.rollout_id for r in opened}
    assert all(r.state == "open" for r in opened)
    assert all(r.state == "closed" for r in closed)


def test_release_forgets_the_rollout(server: InProcessServer) -> None:
    async def main() -> Any:
        await _chat(server, "cp-release", turns=1)
        async with control(server) as cp:
            await cp.close("cp-release")
            await cp.release("cp-release")
            with pytest.raises(ControlNotFound) as info:
                await cp.release("cp-release")
            return info.value, await cp.rollouts()

    error, listed = anyio.run(main)
    assert (error.status, error.code) == (404, "unknown_rollout")
    assert "cp-release" not in {r.rollout_id for r in listed}


def test_metrics_count_calls_and_vllm_metrics_still_serve(server: InProcessServer) -> None:
    _settle_chat(server, "cp-metrics")

    async def scrape() -> str:
        async with control(server) as cp:
            return await cp.metrics()

    text = anyio.run(scrape)
    for name in (
        "tokcap_calls_admitted_total",
        "tokcap_calls_staged_total",
        'tokcap_ledger_entries_total{kind="admitted"}',
        "tokcap_staged_bytes_total",
        "tokcap_stage_seconds_bucket",
        'tokcap_rollouts{state="open"}',
    ):
        assert name in text, name
    vllm = httpx.get(f"{server.base_url}/metrics", timeout=60)
    assert vllm.status_code == 200
    assert "http_request_duration_seconds" in vllm.text  # vLLM's own registry, untouched
    assert "tokcap_" not in vllm.text


def test_the_client_enforces_the_manifest_bound_before_parsing(server: InProcessServer) -> None:
    async def main() -> tuple[Any, ...]:
        await _chat(server, "cp-big", turns=2)
        async with control(server, max_manifest_bytes=200) as cp:
            await cp.close("cp-big")
            with pytest.raises(ManifestError) as info:
                await cp.manifest("cp-big")
            return info.value, await cp.fetch_receipts(["cp-big"])

    error, (receipt,) = anyio.run(main)
    assert error.code == "too_large"
    assert receipt.failure_reason == "manifest_invalid:too_large"


# ---- client retries, on a scripted transport (no server) ----------------------------------


def test_the_client_retries_idempotent_calls_only() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) <= 2:
            raise httpx.ReadError("connection reset")
        return httpx.Response(200, json={"rollouts": [], "next_cursor": None})

    async def main() -> None:
        transport = httpx.MockTransport(handler)
        async with ControlPlaneClient(
            "http://gate", "t", transport=transport, backoff_s=0.001
        ) as cp:
            assert await cp.rollouts() == []
            assert seen == ["GET", "GET", "GET"]
            seen.clear()
            with pytest.raises(ControlUnreachable) as info:
                await cp.close("r1", reward=1.0)  # the request may have arrived: not retried
            assert seen == ["POST"]
            assert info.value.code == "unreachable"

    anyio.run(main)


def test_a_post_that_never_left_is_retried_and_a_retried_delete_may_find_it_gone() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) == 1:
            raise httpx.ConnectError("refused")
        if request.method == "DELETE" and len(seen) == 3:
            raise httpx.ReadError("reset after the gate released it")
        if request.method == "DELETE":
            body = {
                "error": {"message": "gone", "type": "NotFoundError", "code": "unknown_rollout"}
            }
            return httpx.Response(404, json=body)
        return httpx.Response(200, json={"rollout_id": "r1", "head": {"seq": 3, "hash": "ab"}})

    async def main() -> None:
        transport = httpx.MockTransport(handler)
        async with ControlPlaneClient(
            "http://gate", "t", transport=transport, backoff_s=0.001
        ) as cp:
            assert await cp.close("r1", reward=1.0) == (3, "ab")
            await cp.release("r1")
            with pytest.raises(ControlNotFound):
                await cp.release("r1")  # a first-attempt 404 is the caller's to see
        assert seen == ["POST", "POST", "DELETE", "DELETE", "DELETE"]

    anyio.run(main)
