"""Hostile clients, part 2 (issue #24): nine more ways a client was answered 200 with nothing
in the ledger, or crashed the server, and the six decisions taken on questionable inputs.

Each case is a named regression test on the session gate (a real vLLM CPU engine behind
the real HTTP server). The rule every case checks: a captured path never completes a
response (a 200 body, or a stream that ends normally) for a call the ledger does not hold
as served, and no input reaches a 5xx (a 503 here is the gate's own state, never the
input). After each abuse `_assert_serving` checks health, vLLM's own routes, and that a
fresh rollout captures, closes and verifies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.vllm._helpers import client, control, events, long_stream, wait_until
from tests.vllm.test_containment import _file_size_limit
from tests.vllm.test_hostile import AUTH, _assert_serving, _body, _code, _post, _verified
from tokcap_core.ledger import Admitted, Failed, Staged
from tokcap_vllm import InProcessServer, WeightSync
from tokcap_vllm.weights import WeightPushError

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _held(server: InProcessServer, rollout_id: str) -> bool:
    return rollout_id in server.gate.rollouts()


def _health(server: InProcessServer) -> dict[str, Any]:
    with httpx.Client(timeout=60) as http:
        answer = http.get(f"{server.base_url}/tokcap/v1/health", headers=AUTH)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _control(server: InProcessServer, method: str, tail: str, body: Any = None) -> httpx.Response:
    with httpx.Client(timeout=120) as http:
        return http.request(
            method, f"{server.base_url}/tokcap/v1/rollouts/{tail}", json=body, headers=AUTH
        )


def _unfinished(server: InProcessServer) -> int:
    async def count() -> int:
        return int(server.engine_client.output_processor.get_num_unfinished_requests())

    return int(server.call(count))


# ---- B1, B2: request ids the ledger cannot store ------------------------------------------


def test_b1_an_empty_request_id_header_is_refused_before_admission(
    server: InProcessServer,
) -> None:
    """vLLM takes an empty ``X-Request-Id`` as given (every response id ``chatcmpl-``)."""
    for _ in range(2):
        answer = _post(server, "hx2-b1", _body(server, "a"), headers={"x-request-id": ""})
        assert _code(answer) == (400, "bad_request_id")
    assert not _held(server, "hx2-b1")
    _assert_serving(server, "hx2-b1-after")


@pytest.mark.parametrize(
    ("where", "request_id"),
    [
        ("header", "a" * 248),
        ("header", "x" * 10_000),
        ("body", "a" * 248),
        ("body", "tab\there"),
        ("body", "new\nline"),
        ("body", "caf\u00e9"),
        ("body", "x" * 10_000),
        ("body", ""),
    ],
)
def test_b2_a_request_id_the_ledger_cannot_store_is_refused(
    server: InProcessServer, where: str, request_id: str
) -> None:
    """Response ids are 1..256 printable ASCII in the ledger, ``chatcmpl-`` included."""
    rollout_id = f"hx2-b2-{where}-{len(request_id)}-{sum(map(ord, request_id)) % 997}"
    if where == "header":
        answer = _post(server, rollout_id, _body(server, "a"), headers={"x-request-id": request_id})
    else:
        answer = _post(server, rollout_id, _body(server, "a", request_id=request_id))
    assert _code(answer) == (400, "bad_request_id")
    assert not _held(server, rollout_id)
    _assert_serving(server, rollout_id + "-after")


def test_b2_a_request_id_at_the_bound_is_captured_and_verifies(server: InProcessServer) -> None:
    answer = _post(server, "hx2-b2-edge", _body(server, "a"), headers={"x-request-id": "r" * 247})
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "chatcmpl-" + "r" * 247
    assert _verified(server, "hx2-b2-edge")


# ---- B3, B9: nesting past Python's recursion limit -----------------------------------------


def _deep_tool_message(depth: int) -> dict[str, Any]:
    arguments = "[" * depth + "]" * depth
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


@pytest.mark.parametrize("depth", [990, 5_000])
def test_b3_tool_call_arguments_nested_deep_are_a_typed_400(
    server: InProcessServer, depth: int
) -> None:
    """Past Python's recursion limit: 400 ``bad_json``. At 990 the limit is reached or not
    depending on the stack the decode runs on: then the call is captured and verifies."""
    messages = [
        {"role": "user", "content": "call f"},
        _deep_tool_message(depth),
        {"role": "tool", "tool_call_id": "t1", "content": "done"},
    ]
    body = {"model": server.model, "messages": messages, "max_tokens": 3}
    rollout_id = f"hx2-b3-{depth}"
    answer = _post(server, rollout_id, body)
    if depth < 1000 and answer.status_code == 200:
        assert _verified(server, rollout_id)
    else:
        assert _code(answer) == (400, "bad_json")
        assert not _held(server, rollout_id)
    _assert_serving(server, f"hx2-b3-after-{depth}")


def test_b9_a_close_witness_nested_deep_is_a_typed_400_and_harms_nothing(
    server: InProcessServer,
) -> None:
    assert _post(server, "hx2-b9", _body(server, "a")).status_code == 200
    deep = _deep_tool_message(2_000)["tool_calls"]
    answer = _control(
        server, "POST", "hx2-b9/close", {"reward": 1.0, "witnesses": {"tool_calls": deep}}
    )
    assert _code(answer) == (400, "bad_json")
    assert server.gate.rollouts()["hx2-b9"] == "open"
    assert _verified(server, "hx2-b9")
    _assert_serving(server, "hx2-b9-after")


# ---- B4, B5: the rollout header on endpoints the gate does not capture ----------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "hello"}),
        (
            "/v1/messages/count_tokens",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("/v1/responses/resp_x/cancel", {}),
    ],
)
def test_b4_the_rollout_header_on_an_uncaptured_endpoint_is_refused(
    server: InProcessServer, path: str, body: dict[str, Any]
) -> None:
    rollout_id = f"hx2-b4-{len(json.dumps(body))}"
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        refused = http.post(
            path, json={"model": server.model, **body}, headers={"x-tokcap-rollout-id": rollout_id}
        )
        assert _code(refused) == (404, "uncaptured_endpoint")
        plain = http.post(path, json={"model": server.model, **body})  # no header: vLLM's
        if plain.status_code >= 400:
            assert plain.json().get("error", {}).get("code") != "uncaptured_endpoint"
    assert not _held(server, rollout_id)
    _assert_serving(server, rollout_id + "-after")


# ---- B6: close while a call is generating ---------------------------------------------------


@pytest.fixture
def aborts(server: InProcessServer) -> Iterator[list[str]]:
    """The request ids vLLM's engine client aborts (a spy on `AsyncLLM.abort`: it records
    and delegates, so the engine really aborts)."""
    engine = server.engine_client
    seen: list[str] = []
    original = engine.abort

    async def spy(request_id: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend([request_id] if isinstance(request_id, str) else list(request_id))
        return await original(request_id, *args, **kwargs)

    engine.abort = spy
    yield seen
    del engine.abort


def test_b6_close_while_a_plain_call_generates_answers_409_and_stops_the_engine(
    server: InProcessServer, aborts: list[str]
) -> None:
    body = _body(server, "long", max_tokens=4000, ignore_eos=True)
    url = server.rollout_url("hx2-b6") + "/chat/completions"

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as http, control(server) as cp:
            out: dict[str, httpx.Response] = {}

            async def call() -> None:
                out["r"] = await http.post(url, json=body, headers={"x-request-id": "b6-plain"})

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                while _unfinished(server) < 1:
                    await anyio.sleep(0.05)
                await cp.close("hx2-b6", reward=0.0)
        return out["r"]

    answer = anyio.run(main)
    assert _code(answer) == (409, "rollout_closed")
    assert any("b6-plain" in request_id for request_id in aborts)
    wait_until(
        lambda: _unfinished(server) == 0, "the engine dropped the aborted request", every_s=0.05
    )
    evs = events(server, "hx2-b6")
    assert [type(e).__name__ for e in evs] == ["Admitted", "Failed", "Closed"]
    assert (evs[1].reason, evs[1].served) == ("uncommitted_call:closed_in_flight", False)
    assert not [k for k in server.call(server.gate.sink.staged_keys) if k.startswith("hx2-b6/")]
    _assert_serving(server, "hx2-b6-after")


def test_b6_close_while_a_stream_generates_ends_it_with_an_error_event(
    server: InProcessServer, aborts: list[str]
) -> None:
    async def main() -> tuple[int, str]:
        chunks, error = 0, ""
        async with client(server, "hx2-b6s") as c, control(server) as cp:
            stream = await long_stream(c, server, 4000, extra_headers={"x-request-id": "b6-stream"})
            try:
                async for _ in stream:
                    chunks += 1
                    if chunks == 3:
                        await cp.close("hx2-b6s", reward=0.0)
            except openai.APIError as e:
                error = str(e)
        return chunks, error

    chunks, error = anyio.run(main)
    assert error.startswith("[rollout_closed]"), error  # never a normal end
    assert chunks < 4000
    assert any("b6-stream" in request_id for request_id in aborts)
    wait_until(
        lambda: _unfinished(server) == 0, "the engine dropped the aborted request", every_s=0.05
    )
    failed = [e for e in events(server, "hx2-b6s") if isinstance(e, Failed)]
    assert [(f.reason, f.served) for f in failed] == [("uncommitted_call:closed_in_flight", False)]
    _assert_serving(server, "hx2-b6s-after")


# ---- B7: a ledger file that cannot grow ------------------------------------------------------


def test_b7_health_stays_degraded_while_the_ledger_file_cannot_grow(
    server: InProcessServer,
) -> None:
    gate = server.gate
    assert gate.ledger_file is not None
    server.call(gate.drain)
    size = gate.ledger_file.path.stat().st_size
    with _file_size_limit(size):
        first = _post(server, "hx2-b7-a", _body(server, "a"))
        assert _code(first) == (503, "ledger_write_failed")  # never served into a poisoned rollout
        assert _control(server, "POST", "hx2-b7-a/close", {"reward": 1.0}).status_code == 200
        assert _control(server, "DELETE", "hx2-b7-a").status_code == 200
        health = _health(server)
        assert health["status"] == "degraded", health  # nothing poisoned held, file still full
        assert "ledger_write_failed" in health["ledger_error"]
        assert _code(_post(server, "hx2-b7-b", _body(server, "b"))) == (503, "ledger_write_failed")
        assert _code(_post(server, "hx2-b7-b", _body(server, "c"))) == (409, "rollout_poisoned")
    _assert_serving(server, "hx2-b7-after")  # the file grows again
    assert _control(server, "POST", "hx2-b7-b/close", {}).status_code == 200
    assert _control(server, "DELETE", "hx2-b7-b").status_code == 200
    assert _health(server)["status"] == "ok"


# ---- B8: weight versions the ledger cannot store ------------------------------------------------


def test_b8_a_weight_version_past_the_ledger_bound_is_refused_before_loading(
    server: InProcessServer,
) -> None:
    async def push() -> tuple[str, int, int]:
        sync = await WeightSync.connect(server.engine_client)
        before = sync.state.version
        try:
            await sync.push({}, 2**63)
        except WeightPushError as e:
            return e.code, before, sync.state.version
        return "accepted", before, sync.state.version

    code, before, after = server.call(push)
    assert (code, after) == ("bad_version", before)
    _assert_serving(server, "hx2-b8-after")


# ---- the decisions -----------------------------------------------------------------------------


def test_q1_a_poisoned_rollout_refuses_every_later_call_keyed_or_not(
    server: InProcessServer,
) -> None:
    """The session sink refuses rollouts named ``fail-*``: the first call is served and its
    commit fails (``Failed(served=True)``); every later call is 409 ``rollout_poisoned``."""
    assert _post(server, "fail-hx2-q1", _body(server, "a")).status_code == 200
    server.call(server.gate.drain)
    key = {"idempotency-key": "q1"}
    answers = [_post(server, "fail-hx2-q1", _body(server, "b"), headers=key) for _ in range(3)]
    assert [_code(a) for a in answers] == [(409, "rollout_poisoned")] * 3
    assert _code(_post(server, "fail-hx2-q1", _body(server, "c"))) == (409, "rollout_poisoned")
    assert sum(isinstance(e, Admitted) for e in events(server, "fail-hx2-q1")) == 1
    assert not _verified(server, "fail-hx2-q1")
    _assert_serving(server, "hx2-q1-after")


def test_q2_a_retry_serialised_differently_is_a_reused_key(server: InProcessServer) -> None:
    """The fingerprint of an idempotent request is its exact bytes."""
    body = _body(server, "retry")
    raw = json.dumps(body).encode()
    other = json.dumps(dict(reversed(list(body.items()))), indent=1).encode()
    headers = {"idempotency-key": "q2", "content-type": "application/json"}
    url = server.rollout_url("hx2-q2") + "/chat/completions"
    with httpx.Client(timeout=120) as http:
        first = http.post(url, content=raw, headers=headers)
        again = http.post(url, content=raw, headers=headers)
        reordered = http.post(url, content=other, headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert _code(reordered) == (409, "idempotency_key_reused")
    assert [type(e).__name__ for e in events(server, "hx2-q2")] == ["Admitted", "Staged"]
    assert _verified(server, "hx2-q2")


def test_q3_a_malformed_content_fingerprint_is_refused_and_harms_nothing(
    server: InProcessServer,
) -> None:
    """(Unknown terminals: tests/vllm/test_control_plane.py.)"""
    assert _post(server, "hx2-q3", _body(server, "a")).status_code == 200
    for fingerprint in ["xyz", "A" * 64, "0" * 63]:
        answer = _control(
            server,
            "POST",
            "hx2-q3/close",
            {"reward": 1.0, "witnesses": {"content_fingerprint": fingerprint}},
        )
        assert _code(answer) == (422, "bad_content_fingerprint")
    unknown = _control(server, "POST", "hx2-q3/terminal", {"call_id": "c000002"})
    assert _code(unknown) == (422, "unknown_terminal")
    assert server.gate.rollouts()["hx2-q3"] == "open"
    assert _verified(server, "hx2-q3")


def test_q4_requests_vllm_refuses_after_admission_leave_no_rollout_behind(
    server: InProcessServer,
) -> None:
    before = _health(server)["rollouts_open"]
    for i in range(20):
        answer = _post(server, f"hx2-q4-{i}", _body(server, "a", temperature=-1.0))
        assert 400 <= answer.status_code < 500, answer.text
        assert not _held(server, f"hx2-q4-{i}")
    assert _health(server)["rollouts_open"] == before
    # a rollout with a served call keeps it, whatever vLLM refuses later
    assert _post(server, "hx2-q4-kept", _body(server, "a")).status_code == 200
    assert _post(server, "hx2-q4-kept", _body(server, "b", temperature=-1.0)).status_code == 400
    assert _held(server, "hx2-q4-kept")
    assert _verified(server, "hx2-q4-kept")
    _assert_serving(server, "hx2-q4-after")


def test_q5_truncate_prompt_tokens_is_refused(server: InProcessServer) -> None:
    answer = _post(server, "hx2-q5", _body(server, "a", truncate_prompt_tokens=2))
    assert _code(answer) == (400, "truncate_prompt_tokens_unsupported")
    assert not _held(server, "hx2-q5")


def test_q6_a_push_in_abort_mode_answers_in_flight_calls_with_an_error_not_a_200(
    server: InProcessServer, tiny_model: Path
) -> None:
    """vLLM's abort mode (like its ``/pause``) ends in-flight requests: the harness gets 503
    ``call_aborted`` (or an error event), the call is off-chain (``Failed(served=False)``),
    and the rollout is not poisoned: its next call is served and it verifies."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    body = _body(server, "long", max_tokens=4000, ignore_eos=True)

    async def main() -> tuple[httpx.Response, str]:
        out: dict[str, Any] = {}
        sync = await anyio.to_thread.run_sync(server.call, WeightSync.connect, server.engine_client)
        async with httpx.AsyncClient(timeout=300) as http, client(server, "hx2-q6s") as c:

            async def plain() -> None:
                out["plain"] = await http.post(
                    server.rollout_url("hx2-q6") + "/chat/completions", json=body
                )

            async def streamed() -> None:
                out["stream"] = ""
                stream = await long_stream(c, server, 4000)
                try:
                    async for _ in stream:
                        pass
                except openai.APIError as e:
                    out["stream"] = str(e)

            async with anyio.create_task_group() as tg:
                tg.start_soon(plain)
                tg.start_soon(streamed)
                while _unfinished(server) < 2:
                    await anyio.sleep(0.05)

                async def push() -> Any:
                    return await sync.push(weights, sync.state.version + 1, mode="abort")

                await anyio.to_thread.run_sync(server.call, push)
        return out["plain"], out["stream"]

    plain, stream_error = anyio.run(main)
    assert _code(plain) == (503, "call_aborted")
    assert stream_error.startswith("[call_aborted]"), stream_error
    for rollout_id in ("hx2-q6", "hx2-q6s"):
        failed = [e for e in events(server, rollout_id) if isinstance(e, Failed)]
        assert [(f.reason, f.served) for f in failed] == [
            ("uncommitted_call:engine_aborted", False)
        ]
        assert _post(server, rollout_id, _body(server, "again")).status_code == 200
        assert sum(isinstance(e, Staged) for e in events(server, rollout_id)) == 1
        assert _verified(server, rollout_id)
    _assert_serving(server, "hx2-q6-after")
