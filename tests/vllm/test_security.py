"""Security of the gate over HTTP (issue #9): auth, secrets, hostile ids, bounds, fuzzed bodies.

On the session gate (tests/vllm/conftest.py). Complements test_control_plane.py (401 matrix
with header variants, client never leaking the token) and test_gate_failures.py (bad chat
bodies, ``..%2f`` and 129-char ids): here every control route goes 401 / 401 / 200, the
comparison is shown to go through `hmac.compare_digest`, hostile ids are sent byte-exact
over a raw socket (httpx normalises ``..`` and refuses CR/LF in headers), and control and
chat bodies are fuzzed with hypothesis: every answer is a typed 2xx/4xx, never 5xx or a hang.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.vllm._helpers import CONTROL_TOKEN, client, control
from tokcap_core import CaptureConfig, decode_manifest
from tokcap_core.errors import ManifestError
from tokcap_vllm import ControlPlaneClient, Gate, GateConfig, InProcessServer
from tokcap_vllm.extend import ControlPlane

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTROL = "/tokcap/v1"
RIGHT = {"authorization": f"Bearer {CONTROL_TOKEN}"}
WRONG = {
    "authorization": "Bearer " + CONTROL_TOKEN[:-1] + ("x" if CONTROL_TOKEN[-1] != "x" else "y")
}
FUZZ_EXAMPLES = int(os.environ.get("TOKCAP_HTTP_FUZZ_EXAMPLES", "100"))
HTTP_FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,  # each input is bounded by the HTTP timeout below instead
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
REQUEST_TIMEOUT_S = 60.0
"""No single answer may take longer: a slower one is a hang."""


def _turn(server: InProcessServer, rollout_id: str) -> None:
    async def chat() -> None:
        async with client(server, rollout_id) as c:
            await c.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": f"hi {rollout_id}"}],
                max_tokens=2,
                temperature=0.0,
            )

    anyio.run(chat)
    server.call(server.gate.drain)


def _raw(server: InProcessServer, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly ``head`` (request line + headers, no final CRLF) and ``body``; status, body."""
    request = head + b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
    with socket.create_connection((server.host, server.port), timeout=REQUEST_TIMEOUT_S) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _typed(status: int, body: bytes) -> None:
    """A 2xx, or a 4xx whose body is an error object with a type and a code."""
    assert 200 <= status < 300 or 400 <= status < 500, (status, body[:300])
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["type"], str), body[:300]
        assert error["code"] not in (None, ""), body[:300]


# ---- authentication ------------------------------------------------------------------------


def test_every_control_route_is_401_without_or_with_a_wrong_token_and_200_with_it(
    server: InProcessServer,
) -> None:
    _turn(server, "sec-auth")
    routes = [  # in an order that succeeds with the right token
        ("GET", "/health", None),
        ("GET", "/metrics", None),
        ("GET", "/rollouts?state=open", None),
        ("GET", "/rollouts/sec-auth/manifest", None),
        ("POST", "/rollouts/sec-auth/terminal", b'{"call_id": "c000001"}'),
        ("POST", "/rollouts/sec-auth/close", b'{"reward": 1.0}'),
        ("DELETE", "/rollouts/sec-auth", None),
    ]
    seen = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for method, path, body in routes:
            url = f"{server.base_url}{CONTROL}{path}"
            statuses = tuple(
                http.request(method, url, headers=h, content=body).status_code
                for h in ({}, WRONG, RIGHT)
            )
            seen.append((method, path, statuses))
    assert [s for *_, s in seen] == [(401, 401, 200)] * len(routes), seen
    assert "sec-auth" not in server.call(_rollouts, server.gate)  # the 401s changed nothing first


async def _rollouts(gate: Gate) -> dict[str, str]:
    return gate.rollouts()


def test_the_token_is_compared_with_hmac_compare_digest(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def recording(a: Any, b: Any) -> bool:
        calls.append((bytes(a), bytes(b)))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        url = f"{server.base_url}{CONTROL}/health"
        assert [http.get(url, headers=h).status_code for h in ({}, WRONG, RIGHT)] == [401, 401, 200]
    token = CONTROL_TOKEN.encode()
    assert calls == [(b"", token), (WRONG["authorization"][7:].encode(), token), (token, token)]


def test_the_token_never_shows_in_logs_repr_metrics_or_error_bodies(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _turn(server, "sec-leak")
    base = f"{server.base_url}{CONTROL}"
    shown: list[str] = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for method, path, body, headers in [
            ("GET", "/metrics", None, RIGHT),
            ("GET", "/rollouts/sec-leak/manifest", None, RIGHT),
            ("GET", "/rollouts/nobody/manifest", None, RIGHT),  # 404
            ("PUT", "/rollouts/sec-leak/close", b"{}", RIGHT),  # 405
            ("DELETE", "/rollouts/sec-leak", None, RIGHT),  # 409
            ("POST", "/rollouts/sec-leak/close", CONTROL_TOKEN.encode(), RIGHT),  # 400 bad_json
            ("POST", "/rollouts/sec-leak/close", b'{"reward": "x"}', RIGHT),  # 422
            ("GET", "/rollouts/%2e%2e/manifest", None, RIGHT),  # 400
            ("GET", "/health", None, WRONG),  # 401
            ("GET", "/health", None, {"authorization": f"Bearer {CONTROL_TOKEN} extra"}),
        ]:
            response = http.request(method, base + path, content=body, headers=headers)
            shown += [response.text, str(response.headers)]
        chat = http.post(
            server.rollout_url("sec-leak") + "/chat/completions",
            content=b"{broken",
            headers=RIGHT,
        )
        shown += [chat.text]
    env_plane = ControlPlane(Gate(GateConfig()), environ={"TOKCAP_CONTROL_TOKEN": CONTROL_TOKEN})
    shown += [
        repr(GateConfig(capture=CaptureConfig(control_token=CONTROL_TOKEN))),
        str(GateConfig(capture=CaptureConfig(control_token=CONTROL_TOKEN))),
        repr(server.gate.config),
        repr(server.gate),
        repr(env_plane),
        repr(control(server)),
        caplog.text,
        *(r.getMessage() for r in caplog.records),
    ]
    leaks = [text[:200] for text in shown if CONTROL_TOKEN in text]
    assert leaks == []
    assert "tokcap_" in shown[0]  # the metrics really were read


# ---- hostile rollout ids (byte-exact, over a raw socket) -------------------------------------

HOSTILE_IDS = [
    "..",
    ".",
    "%2e%2e",
    "%2E%2E",
    "..%2f..%2fetc",
    "a%2fb",
    "a%5cb",
    "%00",
    "a%00b",
    "a%0d%0ab",
    "a" * 129,
    "-lead",
    "%2d",
]


def _one_token_chat(server: InProcessServer) -> bytes:
    """The body of a one-token chat completion on the server's model."""
    chat = {"model": server.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    return json.dumps(chat).encode()


@pytest.mark.parametrize("rollout_id", HOSTILE_IDS)
def test_hostile_rollout_ids_get_400_bad_rollout_id_everywhere(
    server: InProcessServer, rollout_id: str
) -> None:
    body = _one_token_chat(server)
    host = f"host: {server.host}\r\ncontent-type: application/json".encode()
    rid = rollout_id.encode()
    auth = f"authorization: Bearer {CONTROL_TOKEN}".encode()
    answers = {
        "path": _raw(
            server,
            b"POST /tokcap/rollouts/%s/v1/chat/completions HTTP/1.1\r\n%s" % (rid, host),
            body,
        ),
        "manifest": _raw(
            server, b"GET /tokcap/v1/rollouts/%s/manifest HTTP/1.1\r\n%s\r\n%s" % (rid, host, auth)
        ),
        "close": _raw(
            server,
            b"POST /tokcap/v1/rollouts/%s/close HTTP/1.1\r\n%s\r\n%s" % (rid, host, auth),
            b"{}",
        ),
    }
    if "%" not in rollout_id:  # a header value is not percent-decoded
        answers["header"] = _raw(
            server,
            b"POST /v1/chat/completions HTTP/1.1\r\n%s\r\nx-tokcap-rollout-id: %s" % (host, rid),
            body,
        )
    codes = {
        where: (status, json.loads(text)["error"]["code"])
        for where, (status, text) in answers.items()
    }
    assert codes == {where: (400, "bad_rollout_id") for where in answers}


@pytest.mark.parametrize(
    "value",
    [
        b"sec-inj-1\rx-evil: 1",
        b"sec-inj-2\nx-evil: 1",
        b"sec-inj-3\x00",
        b"sec-inj-4\x7f",
        b"sec inj 5",
    ],
    ids=["bare-CR", "bare-LF", "NUL", "DEL", "spaces"],
)
def test_control_characters_in_the_rollout_header_are_refused_with_400(
    server: InProcessServer, value: bytes
) -> None:
    body = _one_token_chat(server)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
    status, _ = _raw(server, head + b"\r\nx-tokcap-rollout-id: " + value, body)
    assert status == 400
    admitted = server.call(_rollouts, server.gate)
    assert not any(rid.startswith("sec-inj") for rid in admitted)


def test_a_crlf_split_header_naming_a_second_rollout_is_refused(server: InProcessServer) -> None:
    """``id\\r\\nX-Tokcap-Rollout-Id: other`` arrives as two rollout headers: ambiguous, so 400."""
    body = _one_token_chat(server)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-tokcap-rollout-id: sec-dup-a\r\nx-tokcap-rollout-id: sec-dup-b"
    )
    status, text = _raw(server, head, body)
    admitted = server.call(_rollouts, server.gate)
    assert "sec-dup-a" not in admitted, (status, text[:200])
    assert "sec-dup-b" not in admitted, (status, text[:200])
    assert (status, json.loads(text)["error"]["code"]) == (400, "bad_rollout_id")


# ---- bounds -----------------------------------------------------------------------------------


def test_decode_manifest_refuses_oversize_input_before_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tokcap_core._manifest as manifest_module

    def no_parsing(*_: Any, **__: Any) -> Any:
        raise AssertionError("parsed an oversize manifest")

    monkeypatch.setattr(manifest_module.json, "loads", no_parsing)
    for data in (b"{" * 1001, "x" * 1001, b"[" + b"1," * 10_000 + b"1]"):
        with pytest.raises(ManifestError) as info:
            decode_manifest(data, max_bytes=1000)
        assert info.value.code == "too_large"


def test_the_client_stops_reading_a_manifest_at_its_bound() -> None:
    """Declared too long: refused on the header. Streamed without a length: cut at the bound."""
    sent = {"chunks": 0}

    async def endless() -> Any:
        for _ in range(10_000):
            sent["chunks"] += 1
            yield b"[" * 1024

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            async for chunk in endless():
                yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        if "declared" in request.url.path:
            return httpx.Response(200, headers={"content-length": str(1 << 30)}, stream=Stream())
        return httpx.Response(200, stream=Stream())

    async def main() -> list[str]:
        codes = []
        transport = httpx.MockTransport(handler)
        async with ControlPlaneClient(
            "http://gate", "t", max_manifest_bytes=4096, transport=transport, retries=0
        ) as cp:
            for rid in ("declared", "streamed"):
                with pytest.raises(ManifestError) as info:
                    await cp.manifest(rid)
                codes.append(info.value.code)
                receipt = await cp.receipt(rid)
                assert receipt.failure_reason == "manifest_invalid:too_large"
        return codes

    assert anyio.run(main) == ["too_large", "too_large"]
    assert sent["chunks"] <= 2 * 6  # two streamed reads stopped near 4 KiB each, not 10 MiB


def test_the_gate_refuses_to_serve_a_manifest_over_its_bound() -> None:
    """``GateConfig.max_manifest_bytes``: 413 ``manifest_too_large``, never a truncated manifest."""
    from tokcap_core.simulate import simulate_rollout

    gate = Gate(
        GateConfig(capture=CaptureConfig(control_token=CONTROL_TOKEN), max_manifest_bytes=600)
    )
    record = gate.book.join("sec-big")
    for entry in simulate_rollout("sec-big", seed=1, turns=3).ledger.entries[:-1]:
        gate._append(record, entry.event)  # what the capture path appends, without an engine

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=ControlPlane(gate))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://gate") as http:
            return await http.get(f"{CONTROL}/rollouts/sec-big/manifest", headers=RIGHT)

    response = anyio.run(main)
    assert (response.status_code, response.json()["error"]["code"]) == (413, "manifest_too_large")


# ---- fuzzing over HTTP ------------------------------------------------------------------------

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_body_bytes = st.one_of(
    st.binary(max_size=200),
    _json.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"NaN", b'{"reward": NaN}', b'{"reward": Infinity}', b"{" * 5000, b"[]"]),
)
_control_body = st.one_of(
    _body_bytes,
    st.fixed_dictionaries(
        {},
        optional={
            "reward": _json_leaf,
            "call_id": _json_leaf | st.sampled_from(["c000001", "c000002", "c999999"]),
            "response_id": _json_leaf,
            "witnesses": _json
            | st.fixed_dictionaries(
                {},
                optional={
                    "response_id": _json_leaf,
                    "content": _json_leaf,
                    "tool_calls": _json,
                    "content_fingerprint": _json_leaf,
                },
            ),
        },
    ).map(lambda v: json.dumps(v).encode()),
)
_segment = st.one_of(
    st.sampled_from(["sec-fz-0", "sec-fz-1", "sec-fz-missing"]),
    st.text(max_size=140).map(lambda t: quote(t, safe="")),
)


@HTTP_FUZZ
@given(
    route=st.sampled_from(
        [
            ("POST", "/close"),
            ("POST", "/terminal"),
            ("GET", "/manifest"),
            ("DELETE", ""),
            ("PATCH", "/close"),
        ]
    ),
    segment=_segment,
    body=_control_body,
    query=st.text(max_size=30).map(lambda t: quote(t, safe="=&")),
)
def test_fuzzed_control_requests_get_typed_answers(
    fuzz_http: httpx.Client, route: tuple[str, str], segment: str, body: bytes, query: str
) -> None:
    method, action = route
    response = fuzz_http.request(
        method, f"{CONTROL}/rollouts/{segment}{action}?{query}", content=body, headers=RIGHT
    )
    _typed(response.status_code, response.content)
    event(f"status {response.status_code}")
    listing = fuzz_http.get(f"{CONTROL}/rollouts?{query}", headers=RIGHT)
    _typed(listing.status_code, listing.content)


_role = st.sampled_from(["user", "assistant", "system", "tool", "developer"]) | st.text(max_size=8)
_content = st.one_of(
    st.text(max_size=40),
    st.none(),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]) | st.text(max_size=5)},
            optional={"text": _json_leaf},
        ),
        max_size=3,
    ),
    _json,
)
_message = st.fixed_dictionaries(
    {"role": _role},
    optional={
        "content": _content,
        "name": _json_leaf,
        "tool_calls": _json,
        "tool_call_id": _json_leaf,
        "reasoning_content": _json_leaf,
    },
)
_options = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-2, 3) | st.sampled_from([10**9, "4", None, 2.5]),
        "n": st.integers(-1, 3) | _json_leaf,
        "temperature": _json_leaf,
        "logprobs": _json_leaf,
        "top_logprobs": st.integers(-1, 30) | _json_leaf,
        "stream": st.booleans() | _json_leaf,
        "stop": _json,
        "tools": _json,
        "extra": _json,
        "seed": _json_leaf,
    },
)


@HTTP_FUZZ
@given(
    rollout=st.sampled_from(["sec-fzc-0", "sec-fzc-1", "sec-fzc-2"]),
    messages=st.lists(_message, max_size=4) | _json,
    options=_options,
    raw=st.none() | _body_bytes,
    endpoint=st.sampled_from(["/chat/completions"] * 4 + ["/completions"]),
)
def test_fuzzed_chat_bodies_get_typed_answers(
    fuzz_http: httpx.Client,
    server: InProcessServer,
    rollout: str,
    messages: Any,
    options: dict[str, Any],
    raw: bytes | None,
    endpoint: str,
) -> None:
    if raw is None:
        doc = {"model": server.model, "messages": messages, "max_tokens": 2, **options}
        if endpoint == "/completions":
            doc = {k: v for k, v in doc.items() if k != "messages"} | {"prompt": messages}
        raw = json.dumps(doc).encode()
    url = f"/tokcap/rollouts/{rollout}/v1{endpoint}"
    response = fuzz_http.post(url, content=raw, headers={"content-type": "application/json"})
    _typed(response.status_code, response.content if response.status_code >= 400 else b"")
    event(f"status {response.status_code}")


@pytest.fixture(scope="module")
def fuzz_http(server: InProcessServer) -> Any:
    """One client for the fuzz tests; afterwards the gate must still be healthy."""
    for rid in ("sec-fz-0", "sec-fz-1", "sec-fzc-0"):
        _turn(server, rid)
    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as http:
        yield http
        health = http.get(f"{CONTROL}/health", headers=RIGHT)
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
    _turn(server, "sec-after-fuzz")  # and still serves captured calls
