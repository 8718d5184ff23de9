"""The logprobs a captured call needs, and the per-token text vLLM no longer makes for them.

When the harness did not ask for logprobs, the host asks the engine for the sampled token's
(``logprobs=0``) and, on the vLLM versions `install_logprob_text_switch` was written for,
marks the request so vLLM skips decoding those tokens to text. Checked on the session
engine against vLLM's own answers to the same request: the captured row's ids are the ids
vLLM returned (``return_token_ids``), its logprobs the ones vLLM shows a harness that asks,
and a harness that asks still gets every token decoded. A counting wrapper around vLLM's
``convert_ids_list_to_tokens`` (the real function, called through) shows which requests
paid for the text.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from tests.vllm._helpers import close_and_reassemble
from tokcap_vllm import InProcessServer
from tokcap_vllm.gate._logprob_text import PATCHED_VERSIONS, install_logprob_text_switch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 12


@pytest.fixture
def decoded_positions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Positions whose logprob tokens vLLM decoded to text, one entry per call (counted)."""
    from vllm.v1.engine import logprobs as vllm_logprobs

    calls: list[int] = []
    real: Callable[..., list[str]] = vllm_logprobs.convert_ids_list_to_tokens

    def counted(tokenizer: Any, token_ids: list[int]) -> list[str]:
        calls.append(len(token_ids))
        return real(tokenizer, token_ids)

    monkeypatch.setattr(vllm_logprobs, "convert_ids_list_to_tokens", counted)
    return calls


def _body(kind: str, server: InProcessServer, task: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": f"{task}: write a loop"}]
    else:
        body["prompt"] = f"{task}: def loop():"
    return body


def _post(server: InProcessServer, kind: str, body: dict[str, Any], rollout: str | None) -> Any:
    path = "chat/completions" if kind == "chat" else "completions"
    base = server.rollout_url(rollout) if rollout is not None else f"{server.base_url}/v1"

    async def post() -> Any:
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(f"{base}/{path}", json=body)
            r.raise_for_status()
            return r.json()

    return anyio.run(post)


def _ids(kind: str, answer: dict[str, Any]) -> tuple[list[int], list[int]]:
    """``(prompt ids, output ids)`` vLLM returned for ``return_token_ids``."""
    choice = answer["choices"][0]
    prompt = answer["prompt_token_ids"] if kind == "chat" else choice["prompt_token_ids"]
    return list(prompt), list(choice["token_ids"])


def _shown(kind: str, answer: dict[str, Any]) -> tuple[list[str], list[float]]:
    """``(token texts, logprobs)`` vLLM showed the harness."""
    logprobs = answer["choices"][0]["logprobs"]
    if kind == "chat":
        content = logprobs["content"]
        return [x["token"] for x in content], [x["logprob"] for x in content]
    return list(logprobs["tokens"]), list(logprobs["token_logprobs"])


def _staged(server: InProcessServer, rollout: str) -> Any:
    receipt, _rows, staged = close_and_reassemble(server, rollout)
    assert receipt.ok
    (call,) = staged.values()
    return call


def _logprobs_request(kind: str) -> dict[str, Any]:
    return {"logprobs": True, "top_logprobs": 0} if kind == "chat" else {"logprobs": 0}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_captured_call_keeps_vllms_ids_and_logprobs_without_their_text(
    server: InProcessServer, kind: str, decoded_positions: list[int]
) -> None:
    """No logprobs asked: the row holds vLLM's own ids and logprobs, and no logprob token was
    decoded; the same request asking for logprobs, uncaptured, shows the same values."""
    rollout = f"lptext-{kind}-plain"
    captured = _post(server, kind, _body(kind, server, rollout), rollout)
    assert captured["choices"][0].get("logprobs") is None  # the harness did not ask
    host = server.engine_client._tokcap_host
    assert host.skips_logprob_text, f"the switch is off on this vLLM (tested: {PATCHED_VERSIONS})"
    assert decoded_positions == []

    reference = _post(server, kind, _body(kind, server, rollout, **_logprobs_request(kind)), None)
    assert sum(decoded_positions) == MAX_TOKENS  # the plain request paid for its tokens' text

    staged = _staged(server, rollout)
    prompt_ids, output_ids = _ids(kind, captured)
    assert (prompt_ids, output_ids) == _ids(kind, reference)
    assert list(staged.tokens) == prompt_ids + output_ids
    assert staged.carry_len == len(prompt_ids)
    texts, logprobs = _shown(kind, reference)
    assert len(staged.logprobs) == len(logprobs) == MAX_TOKENS
    for ours, theirs in zip(staged.logprobs, logprobs, strict=True):
        assert math.isclose(ours, theirs, rel_tol=1e-6, abs_tol=1e-6)
    assert all(isinstance(t, str) for t in texts)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_harness_that_asks_for_logprobs_still_gets_their_tokens_decoded(
    server: InProcessServer, kind: str, decoded_positions: list[int]
) -> None:
    """Logprobs asked on a captured call: vLLM decodes them as for any request, and shows the
    same token texts and logprobs as the uncaptured request; the row holds those logprobs."""
    rollout = f"lptext-{kind}-asked"
    body = _body(kind, server, rollout, **_logprobs_request(kind))
    captured = _post(server, kind, body, rollout)
    assert sum(decoded_positions) == MAX_TOKENS
    reference = _post(server, kind, body, None)

    texts, logprobs = _shown(kind, captured)
    ref_texts, ref_logprobs = _shown(kind, reference)
    assert texts == ref_texts
    assert all(isinstance(t, str) for t in texts)
    assert "".join(texts) == (
        captured["choices"][0]["message"]["content"]
        if kind == "chat"
        else captured["choices"][0]["text"]
    )
    staged = _staged(server, rollout)
    prompt_ids, output_ids = _ids(kind, captured)
    assert list(staged.tokens) == prompt_ids + output_ids
    for ours, shown, theirs in zip(staged.logprobs, logprobs, ref_logprobs, strict=True):
        assert math.isclose(ours, shown, rel_tol=1e-6, abs_tol=1e-6)
        assert math.isclose(shown, theirs, rel_tol=1e-6, abs_tol=1e-6)


def test_prompt_logprobs_asked_without_logprobs_keep_their_text(
    server: InProcessServer, decoded_positions: list[int]
) -> None:
    """vLLM decodes prompt logprobs with the same tokenizer: a captured call asking for them
    (and not for logprobs) is not marked, and shows what the uncaptured request shows."""
    rollout = "lptext-prompt-logprobs"
    body = _body("chat", server, rollout, prompt_logprobs=1)
    captured = _post(server, "chat", body, rollout)
    reference = _post(server, "chat", body, None)
    assert decoded_positions  # both requests' prompt logprobs were decoded

    def shown(answer: dict[str, Any]) -> list[Any]:
        return [
            None if position is None else sorted(position.items())
            for position in answer["prompt_logprobs"]
        ]

    assert shown(captured) == shown(reference)
    tokens = [
        entry["decoded_token"]
        for position in captured["prompt_logprobs"][1:]
        for entry in position.values()
    ]
    assert tokens
    assert all(isinstance(t, str) for t in tokens)
    assert _staged(server, rollout).carry_len == len(_ids("chat", captured)[0])


def test_plain_traffic_is_never_marked(
    server: InProcessServer, decoded_positions: list[int]
) -> None:
    """An uncaptured request that asks for logprobs gets their text whatever the host does."""
    body = _body("chat", server, "lptext-uncaptured", logprobs=True, top_logprobs=2)
    answer = _post(server, "chat", body, None)
    assert sum(decoded_positions) == 3 * MAX_TOKENS  # the sampled token and the top 2
    for position in answer["choices"][0]["logprobs"]["content"]:
        assert isinstance(position["token"], str)
        assert all(isinstance(top["token"], str) for top in position["top_logprobs"])


def test_the_switch_stays_off_on_an_unlisted_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a vLLM version nobody checked the patch against, it reports itself off (the host then
    marks nothing and vLLM decodes as it always did)."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.0.0+unlisted")
    assert install_logprob_text_switch() is False
