"""The gate on a real engine, failure side: bad input, n>1, bad ids, sink failures,
disconnects, retries."""

from __future__ import annotations

import anyio
import httpx
import openai
import pytest

from tests.vllm._helpers import client, close_and_reassemble, events
from tokcap_core.ledger import Admitted, Failed, Staged

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _chat(server, **extra):  # type: ignore[no-untyped-def]
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def test_bad_bodies_n_and_rollout_ids_get_typed_400s(server) -> None:  # type: ignore[no-untyped-def]
    """Bad JSON, wrong types, n>1, path traversal and over-long ids: 400 with a code, nothing
    admitted."""
    base = server.base_url
    with httpx.Client(timeout=60) as http:
        url = server.rollout_url("bad-1") + "/chat/completions"
        cases = [
            (http.post(url, content=b"{not json"), "bad_json"),
            (http.post(url, json={"model": server.model, "messages": "hi"}), "bad_body"),
            (http.post(url, json=_chat(server, n=2)), "n_unsupported"),
            (
                http.post(
                    f"{base}/tokcap/rollouts/..%2f..%2fetc/v1/chat/completions", json=_chat(server)
                ),
                "bad_rollout_id",
            ),
            (
                http.post(
                    f"{base}/tokcap/rollouts/{'a' * 129}/v1/chat/completions", json=_chat(server)
                ),
                "bad_rollout_id",
            ),
            (
                http.post(
                    f"{base}/v1/chat/completions",
                    json=_chat(server),
                    headers={"x-tokcap-rollout-id": "../x"},
                ),
                "bad_rollout_id",
            ),
        ]
        for response, code in cases:
            assert response.status_code == 400, (code, response.text)
            assert response.json()["error"]["code"] == code
        plain = http.post(f"{base}/v1/chat/completions", json=_chat(server))
        assert plain.status_code == 200
    assert "bad-1" not in server.gate.rollouts() or not server.gate.ledger("bad-1").entries


def test_n_greater_than_one_reaches_the_openai_client_as_a_clear_error(server) -> None:  # type: ignore[no-untyped-def]
    """The real client sees BadRequestError naming n=1."""
    import openai

    async def main() -> None:
        async with client(server, "n-1") as c:
            with pytest.raises(openai.BadRequestError, match="n=1"):
                await c.chat.completions.create(
                    model=server.model,
                    messages=[{"role": "user", "content": "x"}],
                    n=2,
                    max_tokens=2,
                )

    anyio.run(main)


def test_sink_failure_poisons_only_its_rollout(server) -> None:  # type: ignore[no-untyped-def]
    """The session sink is the real MemorySink wrapped to fail puts for rollouts named ``fail-*``
    (conftest.FailingSink): that rollout gets Failed(served=True); a concurrent rollout is
    untouched."""

    async def convo(rollout_id: str) -> None:
        async with client(server, rollout_id) as c:
            messages = [{"role": "user", "content": "go"}]
            for _ in range(2):
                r = await c.chat.completions.create(
                    model=server.model, messages=messages, max_tokens=4, temperature=0
                )
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "more"},
                ]

    async def poisoned_convo() -> None:  # its second call is refused (issue #24, Q1)
        with pytest.raises(openai.ConflictError) as refused:
            await convo("fail-1")
        assert refused.value.code in ("rollout_poisoned", "parent_not_committed")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(poisoned_convo)
            tg.start_soon(convo, "fine-1")

    anyio.run(main)
    failed = [e for e in events(server, "fail-1") if isinstance(e, Failed)]
    assert failed
    assert failed[0].served
    assert failed[0].reason == "stage_failed:injected_put_failure"
    receipt, _, _ = close_and_reassemble(server, "fail-1")
    assert receipt.status == "poisoned"
    good, rows, _ = close_and_reassemble(server, "fine-1")
    assert good.ok
    assert len(good.segments[0]) == 2
    assert rows


def test_client_disconnect_mid_stream_is_uncommitted_and_not_staged(server) -> None:  # type: ignore[no-untyped-def]
    """Closing a stream early: Failed(served=False, uncommitted_call:...), no row left in the
    sink."""

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            body = _chat(server, stream=True, max_tokens=3000, ignore_eos=True)
            async with http.stream(
                "POST", server.rollout_url("drop-1") + "/chat/completions", json=body
            ) as response:
                async for _ in response.aiter_bytes():
                    break  # first chunk, then hang up
        await anyio.sleep(2.0)

    anyio.run(main)
    evs = events(server, "drop-1")
    assert isinstance(evs[0], Admitted)
    assert not any(isinstance(e, Staged) for e in evs)
    (failed,) = [e for e in evs if isinstance(e, Failed)]
    assert not failed.served
    assert failed.reason.startswith("uncommitted_call")
    assert not [k for k in server.call(server.gate.sink.staged_keys) if k.startswith("drop-1/")]


def test_retry_with_the_same_idempotency_key_returns_the_committed_call(server) -> None:  # type: ignore[no-untyped-def]
    """A harness retry carrying the same Idempotency-Key gets the same response; no sibling is
    minted."""
    url = server.rollout_url("retry-1") + "/chat/completions"
    with httpx.Client(timeout=60) as http:
        first = http.post(url, json=_chat(server), headers={"idempotency-key": "k1"})
        second = http.post(url, json=_chat(server), headers={"idempotency-key": "k1"})
    assert first.status_code == second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert [type(e).__name__ for e in events(server, "retry-1")] == ["Admitted", "Staged"]


def test_plain_traffic_is_not_captured(server) -> None:  # type: ignore[no-untyped-def]
    """Calls without a rollout id are served by vLLM as usual and recorded nowhere."""
    before = server.gate.rollouts()
    with httpx.Client(timeout=60) as http:
        r = http.post(
            f"{server.base_url}/v1/completions",
            json={"model": server.model, "prompt": "x", "max_tokens": 2},
        )
    assert r.status_code == 200
    assert server.gate.rollouts() == before


def test_completions_endpoint_chains_text_prompts(server) -> None:  # type: ignore[no-untyped-def]
    """/v1/completions: a prompt extending the previous prompt + returned text is a child call."""

    async def main() -> None:
        async with client(server, "cmpl-1") as c:
            prompt = "def f(x):"
            for _ in range(3):
                r = await c.completions.create(
                    model=server.model, prompt=prompt, max_tokens=4, temperature=0
                )
                prompt = prompt + r.choices[0].text + "\n# next"

    anyio.run(main)
    admitted = [e for e in events(server, "cmpl-1") if isinstance(e, Admitted)]
    assert [a.parent_id for a in admitted] == [None, "c000001", "c000002"]
    receipt, rows, _ = close_and_reassemble(server, "cmpl-1")
    assert receipt.ok
    assert len(rows[0].call_spans) == 3
