"""Issue #33 B3 on a real served gate: every route the server mounts is public (with a
reason), guarded or refused, by the gate's route table checked against the app's real route
table, whatever mounted it (vLLM's routers, ``sagemaker_standards``, runtime LoRA's
``/adapters``, ``--enable-scale-out``'s token routes).

One ``tokcap-vllm serve`` process (the CLI a user runs) with every optional route on:
``VLLM_SERVER_DEV_MODE=1``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` with ``--enable-lora``,
``--enable-scale-out``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e._gates import ENGINE_ENV, VLLM_ARGS
from tokcap.compose import SERVED_ENV, ServedGate

pytestmark = [pytest.mark.integration]

TOKEN = "hostile3-routes-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MUST_NOT_BE_OPEN = {
    "/adapters",
    "/adapters/{adapter_name}",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/kv_event_sources",
    "/load",
    "/invocations",
    "/openapi.json",
    "/inference/v1/abort_requests",
}


@pytest.fixture(scope="module")
def gate(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("routes") / "gate.log"
    options = ["--tokcap-sink", "memory", "--enable-lora", "--max-lora-rank", "8"]
    served = ServedGate(
        tiny_model,
        [*options, "--enable-scale-out", *VLLM_ARGS],
        token=TOKEN,
        log=log,
        env={**SERVED_ENV, **ENGINE_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    try:
        served.wait_healthy(TOKEN, 900)
        yield served.url
    finally:
        served.stop()


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_b3_every_mounted_route_is_listed_and_answers_by_its_class(gate: str) -> None:
    table = httpx.get(gate + "/tokcap/v1/routes", headers=AUTH, timeout=60).json()["routes"]
    paths = {r["path"] for r in table}
    assert paths >= MUST_NOT_BE_OPEN, sorted(MUST_NOT_BE_OPEN - paths)  # all of them mounted
    assert [r["path"] for r in table if not r["listed"]] == []  # nothing left to the default
    assert {r["path"] for r in table if r["access"] == "public"} & MUST_NOT_BE_OPEN == set()
    with httpx.Client(base_url=gate, timeout=60) as http:
        for route in table:
            path = _concrete(route["path"])
            for method in route["methods"] or ["GET"]:
                bare = http.request(method, path, json={})
                if route["access"] == "public":
                    assert bare.status_code != 401, (method, path)
                    continue
                assert bare.status_code == 401, (method, path, bare.text)
                if method != "HEAD":  # a HEAD answer has no body
                    assert bare.json()["error"]["code"] == "unauthorized"
                if route["access"] == "refused" and method != "HEAD":
                    refused = http.request(method, path, json={"lora_name": "a"}, headers=AUTH)
                    assert refused.status_code == 403, (method, path, refused.text)
                    assert refused.json()["error"]["code"] == "route_refused"


def test_b3_no_spelling_reaches_an_adapter_route_and_unlisted_paths_need_the_token(
    gate: str,
) -> None:
    body = {"name": "swap", "src": "/tmp/nowhere", "lora_name": "swap", "lora_path": "/tmp/x"}
    with httpx.Client(base_url=gate, timeout=60) as http:
        for method, path in [
            ("POST", "/adapters"),
            ("POST", "//adapters/"),
            ("DELETE", "/adapters/swap"),
            ("POST", "/v1/load_lora_adapter"),
            ("GET", "/tokcap/rollouts/r1/v1/load_lora_adapter"),
        ]:
            url = gate + path  # absolute: httpx would read "//adapters/" as a host
            assert http.request(method, url, json=body).status_code == 401, (method, path)
            with_token = http.request(method, url, json=body, headers=AUTH)
            assert with_token.status_code == 403, (method, path, with_token.text)
            assert with_token.json()["error"]["code"] == "route_refused"
        assert http.get("/never-mounted").status_code == 401  # fails closed
        assert http.get("/never-mounted", headers=AUTH).status_code == 404  # vLLM's own 404
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 200
        assert http.get("/openapi.json").status_code == 401
        assert http.get("/openapi.json", headers=AUTH).status_code == 200


def test_b3_the_table_names_every_route_vllms_app_builder_mounts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine-free, the same check on the app vLLM's own builder makes (every optional
    router on), so a route a new vLLM release adds fails here first."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tokcap_vllm.control._route_table import route_listing

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", "m", "--enable-scale-out", "--enable-fault-tolerance"]
    )
    app = build_app(args, ("generate",), None)
    listing = route_listing(app.routes)
    assert {path for path, _, _ in listing} >= MUST_NOT_BE_OPEN
    assert [path for path, _, rule in listing if not rule.listed] == []
    assert {
        path for path, _, rule in listing if rule.access == "public"
    } & MUST_NOT_BE_OPEN == set()
