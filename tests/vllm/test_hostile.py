"""Hostile or careless clients never take the gate down or corrupt a ledger (issue #17).

Each case a probe found against ``tokcap-vllm serve`` is a named regression test on the
session gate (a real vLLM CPU engine behind the real HTTP server). After every abuse the
gate still serves: `_assert_serving` checks the gate's health, plain vLLM routes, and that a
fresh rollout captures, closes and verifies.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.vllm._helpers import CONTROL_TOKEN, client, control, events, long_stream
from tokcap_core import assemble_receipt, verify_manifest
from tokcap_core.ledger import Admitted, Failed, Staged, manifest_of
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"authorization": f"Bearer {CONTROL_TOKEN}"}


def _body(server: InProcessServer, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 3,
        "temperature": 0.0,
        **extra,
    }


def _post(server: InProcessServer, rollout_id: str, body: Any, **kw: Any) -> httpx.Response:
    url = server.rollout_url(rollout_id) + "/chat/completions"
    with httpx.Client(timeout=120) as http:
        return http.post(url, json=body, **kw)


def _code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def _verified(server: InProcessServer, rollout_id: str) -> bool:
    async def run() -> bool:
        await server.gate.close(rollout_id, reward=1.0)
        state = verify_manifest(manifest_of(server.gate.ledger(rollout_id)))
        return assemble_receipt(state).ok

    return server.call(run)


def _assert_serving(server: InProcessServer, fresh: str) -> None:
    """The gate is up: health ok, vLLM's own routes answer, a new rollout verifies."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        health = http.get("/tokcap/v1/health", headers=AUTH)
        assert health.status_code == 200, health.text
        assert health.json()["serving"] is True
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 200
    assert _post(server, fresh, _body(server, f"hello {fresh}")).status_code == 200
    assert _verified(server, fresh)


def test_a_duplicated_request_id_is_refused_and_the_gate_keeps_serving(
    server: InProcessServer,
) -> None:
    """Case 1: two calls of one rollout with one request id (header, then body field)."""
    first = _post(server, "hx-dup", _body(server, "a"), headers={"x-request-id": "same-id"})
    assert first.status_code == 200
    assert first.json()["id"] == "chatcmpl-same-id"
    again = _post(server, "hx-dup", _body(server, "b"), headers={"x-request-id": "same-id"})
    assert _code(again) == (409, "duplicate_request_id")
    by_body = _post(server, "hx-dup", _body(server, "c", request_id="same-id"))
    assert _code(by_body) == (409, "duplicate_request_id")
    other = _post(server, "hx-dup-other", _body(server, "d"), headers={"x-request-id": "same-id"})
    assert other.status_code == 200  # another rollout may use the id
    kinds = [type(e).__name__ for e in events(server, "hx-dup")]
    assert kinds == ["Admitted", "Staged"]
    assert _verified(server, "hx-dup")
    assert _verified(server, "hx-dup-other")
    _assert_serving(server, "hx-dup-after")


def test_release_and_reuse_during_a_stream_never_mixes_rollouts(server: InProcessServer) -> None:
    """Case 2: close and release R while it streams, start a new R: the old call lands nowhere."""

    async def main() -> tuple[str, str]:
        old_id = new_id = ""
        async with client(server, "hx-reuse") as c, control(server) as cp:
            stream = await long_stream(c, server, 300)
            chunks = 0
            ended: openai.APIError | None = None
            try:  # the stream ends with an error event, never a normal end
                async for chunk in stream:
                    old_id = chunk.id
                    chunks += 1
                    if chunks == 10:
                        await cp.close("hx-reuse", reward=0.0)
                        await cp.release("hx-reuse")
                        fresh = await c.chat.completions.create(
                            model=server.model,
                            messages=[{"role": "user", "content": "second life"}],
                            max_tokens=4,
                            temperature=0.0,
                        )
                        new_id = fresh.id
            except openai.APIError as e:
                ended = e
            assert "[rollout_closed]" in str(ended)
        return old_id, new_id

    old_id, new_id = anyio.run(main)
    assert old_id != new_id
    server.call(server.gate.drain)
    ledger = server.gate.ledger("hx-reuse")
    staged = [e.event for e in ledger.entries if isinstance(e.event, Staged)]
    assert [s.response_id for s in staged] == [new_id]  # never the old call's
    assert not [k for k in server.call(server.gate.sink.staged_keys) if old_id in k]
    assert _verified(server, "hx-reuse")
    _assert_serving(server, "hx-reuse-after")


def test_concurrent_retries_with_one_idempotency_key_make_one_call(server: InProcessServer) -> None:
    """Case 3: 20 identical requests at once under one key: one call, one response id."""
    body = _body(server, "retry me")
    url = server.rollout_url("hx-retry") + "/chat/completions"

    async def main() -> list[httpx.Response]:
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(timeout=120) as http:

            async def one() -> None:
                answers.append(await http.post(url, json=body, headers={"idempotency-key": "k"}))

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(one)
        return answers

    answers = anyio.run(main)
    assert [a.status_code for a in answers] == [200] * 20
    assert len({a.json()["id"] for a in answers}) == 1
    kinds = [type(e).__name__ for e in events(server, "hx-retry")]
    assert kinds == ["Admitted", "Staged"]
    reused = _post(server, "hx-retry", _body(server, "another"), headers={"idempotency-key": "k"})
    assert _code(reused) == (409, "idempotency_key_reused")
    assert _verified(server, "hx-retry")


def test_a_trailing_slash_is_captured_and_other_rollout_posts_are_refused(
    server: InProcessServer,
) -> None:
    """Case 4: ``.../chat/completions/`` is captured, never redirected to the plain path."""
    url = server.rollout_url("hx-slash") + "/chat/completions/"
    with httpx.Client(timeout=120, follow_redirects=False) as http:
        answer = http.post(url, json=_body(server, "slash"))
        assert answer.status_code == 200, answer.text
        other = http.post(server.rollout_url("hx-slash") + "/embeddings", json={"input": "x"})
    assert _code(other) == (404, "uncaptured_endpoint")
    assert [type(e).__name__ for e in events(server, "hx-slash")] == ["Admitted", "Staged"]
    assert _verified(server, "hx-slash")


def test_malformed_requests_get_typed_answers_never_500(server: InProcessServer) -> None:
    """Case 5: deep nesting, invalid UTF-8, a template the sandbox refuses, reserved kwargs."""
    url = server.rollout_url("hx-bad") + "/chat/completions"
    nested = b"[" * 1000 + b"]" * 1000
    deep = b'{"model": "m", "messages": [{"role": "user", "content": "x", "x": ' + nested + b"}]}"
    cases = {
        "deep": (deep, (400, "bad_json")),
        "utf8": (
            b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            (400, "bad_json"),
        ),
        "sandbox": (
            json.dumps(
                _body(server, "x", chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
            ).encode(),
            (400, "bad_chat_template"),
        ),
        "kwargs": (
            json.dumps(_body(server, "x", chat_template_kwargs={"tokenize": True})).encode(),
            (400, "bad_chat_template_kwargs"),
        ),
    }
    with httpx.Client(timeout=120) as http:
        for name, (raw, expected) in cases.items():
            answer = http.post(url, content=raw, headers={"content-type": "application/json"})
            assert 400 <= answer.status_code < 500, (name, answer.status_code, answer.text)
            if expected is not None:
                assert _code(answer) == expected, name
    assert "hx-bad" not in server.gate.rollouts()  # refused requests leave no rollout behind
    _assert_serving(server, "hx-bad-after")


def test_a_retry_waiting_on_its_key_while_the_rollout_closes_gets_409(
    server: InProcessServer,
) -> None:
    """Case 5: the retry is refused as a conflict (409 rollout_closed), not a 400."""
    body = _body(server, "slow", max_tokens=1000, ignore_eos=True)
    url = server.rollout_url("hx-close-retry") + "/chat/completions"

    async def main() -> tuple[httpx.Response, httpx.Response]:
        out: dict[str, httpx.Response] = {}
        async with httpx.AsyncClient(timeout=120) as http, control(server) as cp:

            async def send(name: str) -> None:
                out[name] = await http.post(url, json=body, headers={"idempotency-key": "slow"})

            async with anyio.create_task_group() as tg:
                tg.start_soon(send, "first")
                await anyio.sleep(0.3)
                tg.start_soon(send, "retry")
                await anyio.sleep(0.3)
                await cp.close("hx-close-retry", reward=0.0)
        return out["first"], out["retry"]

    first, retry = anyio.run(main)
    assert _code(first) == (409, "rollout_closed")  # never a completion (issue #24, B6)
    assert retry.status_code == 409, retry.text
    assert retry.json()["error"]["code"] in ("rollout_closed", "retry_in_flight")
    evs = events(server, "hx-close-retry")
    failed = [e for e in evs if isinstance(e, Failed)]
    assert [f.reason for f in failed] == ["uncommitted_call:closed_in_flight"]
    assert sum(isinstance(e, Admitted) for e in evs) == 1


def test_questionable_inputs_are_refused_as_decided(server: InProcessServer) -> None:
    """Case 6: two Authorization headers, a token in the query, path and header naming
    different rollouts, a prompt far over the context: each refused with its code."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        two = http.get(
            "/tokcap/v1/health",
            headers=[("authorization", AUTH["authorization"]), ("authorization", "Bearer x")],
        )
        assert _code(two) == (400, "duplicate_authorization")
        query = http.get(f"/tokcap/v1/health?token={CONTROL_TOKEN}", headers=AUTH)
        assert _code(query) == (400, "token_in_query")
        assert CONTROL_TOKEN not in query.text
        both = http.post(
            server.rollout_url("hx-q-a").removeprefix(server.base_url) + "/chat/completions",
            json=_body(server, "x"),
            headers={"x-tokcap-rollout-id": "hx-q-b"},
        )
        assert _code(both) == (400, "conflicting_rollout_ids")
        huge = _body(server, "word " * 2_000_000)  # 10 MB of text
        big = http.post(
            server.rollout_url("hx-q-big").removeprefix(server.base_url) + "/chat/completions",
            json=huge,
        )
        assert _code(big) == (400, "prompt_too_long")
    assert not {"hx-q-a", "hx-q-b", "hx-q-big"} & set(server.gate.rollouts())


def test_a_seed_that_would_crash_a_chunking_cpu_engine_is_refused() -> None:
    """vLLM 0.32's CPU runner dies on a seeded request whose prefill is chunked (it rewinds
    the request's generator, which CPU generators refuse). The gate knows when its engine is
    exposed: CPU platform with chunked prefill on. (The engine here is a configuration
    stand-in: the property reads only ``vllm_config.scheduler_config``.)"""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from tokcap_vllm.extend import CaptureHost

    def host(chunked: bool) -> CaptureHost:
        config = SimpleNamespace(scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked))
        return CaptureHost(SimpleNamespace(generate=None, vllm_config=config))

    assert host(chunked=True).seeded_prefill_chunks_crash is current_platform.is_cpu()
    assert not host(chunked=False).seeded_prefill_chunks_crash


def test_the_session_engine_serves_seeded_calls_with_long_prompts(server: InProcessServer) -> None:
    """The test engine runs without chunked prefill (tests/vllm/_helpers.py): many seeded
    calls with long prompts at once are served, and the engine stays up."""
    bodies = [_body(server, f"{i} " + "word " * 700, seed=i, temperature=1.0) for i in range(6)]
    url = server.rollout_url("hx-seeded") + "/chat/completions"

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            out: list[int] = []

            async def one(body: dict[str, Any]) -> None:
                answer = await http.post(
                    url.replace("hx-seeded", f"hx-seeded-{body['seed']}"), json=body
                )
                out.append(answer.status_code)

            async with anyio.create_task_group() as tg:
                for body in bodies:
                    tg.start_soon(one, body)
        return out

    assert anyio.run(main) == [200] * 6
    _assert_serving(server, "hx-seeded-after")


def test_images_a_client_abuses_are_refused_typed_and_harm_nothing(server: InProcessServer) -> None:
    """Issue #35 on the session gate, whose model takes no images: an image named by a client
    UUID (first sent with its bytes, then the UUID alone, which vLLM would answer from its
    cache without seeing content), a remote URL the gate was not allowed to fetch, a
    malformed data URL, an oversized image and a well-formed image: each a typed 4xx before
    anything reaches a ledger. (A history whose image was swapped, on the tiny VLM:
    ``test_vlm_turns``.)"""
    png = (  # a 1x1 PNG
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5Erk"
        "Jggg=="
    )
    good = {"url": f"data:image/png;base64,{png}"}
    cases = [
        ({"type": "image_url", "image_url": good, "uuid": "img-1"}, (400, "media_uuid_refused")),
        ({"type": "image_url", "image_url": None, "uuid": "img-1"}, (400, "media_uuid_refused")),
        (
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}},
            (400, "remote_media_refused"),
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}},
            (400, "bad_data_url"),
        ),
        (
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + "A" * 28_000_000},
            },
            (413, "media_too_large"),
        ),
        ({"type": "image_url", "image_url": good}, (400, "unsupported_content")),
    ]
    for n, (part, expected) in enumerate(cases):
        body = _body(server, "x")
        body["messages"][0]["content"] = [part, {"type": "text", "text": "what is it?"}]
        assert _code(_post(server, f"hx-img-{n}", body)) == expected, part
    assert not {f"hx-img-{n}" for n in range(len(cases))} & set(server.gate.rollouts())
    _assert_serving(server, "hx-img-after")
