"""A stateful, model-based test of the gate against the real server (issue #17).

Hypothesis drives a `RuleBasedStateMachine` over the session gate (real vLLM CPU engine,
real HTTP): admit calls (plain or streaming, with or without an idempotency key), duplicate
a request id, fire concurrent retries under one key, disconnect mid-stream, declare a
terminal, close, release and reuse a released id, send bad bodies. A small model of each
rollout predicts every answer; after every step the invariants hold:

- the gate serves (health 200, ``serving``) and nothing answered 5xx;
- no ledger holds another rollout's call (every committed response id is one this rollout
  was answered with);
- one idempotency key is one call (its response id is committed at most once);
- a closed rollout verifies (no rule here makes a rollout fail).

Issue #24 adds the second hostile pass: request ids the ledger cannot store, the rollout
header on endpoints the gate does not capture, tool-call arguments nested past Python's
recursion limit, a close while a stream generates (the stream ends with an error event,
never ``[DONE]``), a terminal naming no call and a malformed witness fingerprint (refused,
the rollout unharmed), and requests vLLM itself refuses (nothing left behind).

The CI profile runs a few short programs; ``TOKCAP_GATE_MODEL_EXAMPLES`` and
``TOKCAP_GATE_MODEL_STEPS`` make it longer (``bench/soak_gate_model.py``).
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from tests.vllm._helpers import CONTROL_TOKEN
from tokcap_core import assemble_receipt, verify_manifest
from tokcap_core.ledger import Admitted, Staged, manifest_of
from tokcap_vllm import InProcessServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = int(os.environ.get("TOKCAP_GATE_MODEL_EXAMPLES", "3"))
STEPS = int(os.environ.get("TOKCAP_GATE_MODEL_STEPS", "14"))
AUTH = {"authorization": f"Bearer {CONTROL_TOKEN}"}
BAD_BODIES = [
    b"{",
    b'{"messages": []}',
    b'{"messages": [{"role": "user", "content": "x"}], "n": 2}',
    b'{"messages": "not a list"}',
    b"[" * 600 + b"]" * 600,
]
_SERVER: InProcessServer | None = None


@dataclass
class _Rollout:
    """What the model knows of one rollout id's current life."""

    rollout_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    """Response ids this life of the rollout was answered with."""
    keys: dict[str, str] = field(default_factory=dict)
    """Idempotency key → the response id every use of it returned."""
    request_ids: set[str] = field(default_factory=set)
    state: str = "open"  # open | closed | released
    unanswered: bool = False
    """A call of this life was admitted and left unanswered (its abandon may still be due)."""


class GateModel(RuleBasedStateMachine):
    """The gate's observable behaviour, rule by rule."""

    rollouts = Bundle("rollouts")

    def __init__(self) -> None:
        super().__init__()
        assert _SERVER is not None
        self.server = _SERVER
        self.http = httpx.Client(base_url=self.server.base_url, timeout=120)
        self.tag = uuid.uuid4().hex[:8]
        self.count = itertools.count()
        self.lives: dict[str, _Rollout] = {}

    def teardown(self) -> None:
        self.http.close()

    # ---- helpers ---------------------------------------------------------------------

    def _url(self, rollout_id: str) -> str:
        return f"/tokcap/rollouts/{rollout_id}/v1/chat/completions"

    def _body(self, life: _Rollout, **extra: Any) -> dict[str, Any]:
        turn = len(life.answered)
        messages = [
            *life.messages,
            {"role": "user", "content": f"step {turn} of {life.rollout_id}"},
        ]
        return {
            "model": self.server.model,
            "messages": messages,
            "max_tokens": 3,
            "temperature": 0.0,
            **extra,
        }

    def _closed(self, rollout_id: str, life: _Rollout) -> None:
        """The gate closed the rollout: its receipt verifies, ok exactly when a call was
        answered."""
        life.state = "closed"
        receipt = assemble_receipt(
            verify_manifest(manifest_of(self.server.gate.ledger(rollout_id)))
        )
        assert receipt.ok == bool(life.answered), receipt

    def _took(self, life: _Rollout, body: dict[str, Any], answer: dict[str, Any]) -> None:
        life.messages = [
            *body["messages"],
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""},
        ]
        life.answered.add(answer["id"])

    def _expect_closed(self, answer: httpx.Response) -> None:
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "rollout_closed"

    # ---- rules -----------------------------------------------------------------------

    @rule(target=rollouts)
    def new_rollout(self) -> str:
        rollout_id = f"sm-{self.tag}-{next(self.count)}"
        self.lives[rollout_id] = _Rollout(rollout_id)
        return rollout_id

    @rule(rollout_id=rollouts, keyed=st.booleans())
    def admit(self, rollout_id: str, keyed: bool) -> None:
        life = self.lives[rollout_id]
        body = self._body(life)
        headers = {"idempotency-key": f"k{next(self.count)}"} if keyed else {}
        answer = self.http.post(self._url(rollout_id), json=body, headers=headers)
        if life.state == "closed":
            self._expect_closed(answer)
            return
        assert answer.status_code == 200, answer.text
        if life.state == "released":  # a released id starts a new, unrelated rollout
            self.lives[rollout_id] = life = _Rollout(rollout_id)
        self._took(life, body, answer.json())
        if keyed:
            life.keys[headers["idempotency-key"]] = answer.json()["id"]

    @rule(rollout_id=rollouts)
    def admit_streaming(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        if life.state != "open":
            return
        body = self._body(life, stream=True)
        content, response_id = "", ""
        with self.http.stream("POST", self._url(rollout_id), json=body) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = httpx.Response(200, content=line[6:]).json()
                    response_id = chunk["id"]
                    for choice in chunk["choices"]:
                        content += choice["delta"].get("content") or ""
        life.messages = [*body["messages"], {"role": "assistant", "content": content}]
        life.answered.add(response_id)

    @rule(rollout_id=rollouts)
    def duplicate_request_id(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        if life.state != "open":
            return
        request_id = f"rq-{self.tag}-{next(self.count)}"
        body = self._body(life)
        first = self.http.post(
            self._url(rollout_id), json=body, headers={"x-request-id": request_id}
        )
        assert first.status_code == 200, first.text
        self._took(life, body, first.json())
        again = self.http.post(
            self._url(rollout_id), json=self._body(life), headers={"x-request-id": request_id}
        )
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "duplicate_request_id"

    @rule(rollout_id=rollouts, copies=st.integers(2, 5))
    def concurrent_retries(self, rollout_id: str, copies: int) -> None:
        life = self.lives[rollout_id]
        if life.state != "open":
            return
        body, key = self._body(life), f"ck{next(self.count)}"
        url = self.server.base_url + self._url(rollout_id)

        async def burst() -> list[httpx.Response]:
            out: list[httpx.Response] = []
            async with httpx.AsyncClient(timeout=120) as http:

                async def one() -> None:
                    out.append(await http.post(url, json=body, headers={"idempotency-key": key}))

                async with anyio.create_task_group() as tg:
                    for _ in range(copies):
                        tg.start_soon(one)
            return out

        answers = anyio.run(burst)
        assert [a.status_code for a in answers] == [200] * copies, [a.text for a in answers]
        ids = {a.json()["id"] for a in answers}
        assert len(ids) == 1, ids
        self._took(life, body, answers[0].json())
        life.keys[key] = ids.pop()

    @rule(rollout_id=rollouts)
    def disconnect(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        if life.state != "open":
            return
        body = self._body(life, stream=True, max_tokens=200, ignore_eos=True)
        with self.http.stream("POST", self._url(rollout_id), json=body) as answer:
            assert answer.status_code == 200
            next(answer.iter_lines())  # leave after the first line: history unchanged
        life.unanswered = True

    @rule(rollout_id=rollouts)
    def declare_terminal(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        if life.state != "open" or not life.answered:
            return
        self.server.call(self.server.gate.drain)
        last = self._last_committed(rollout_id)
        if last is None:
            return
        answer = self.http.post(
            f"/tokcap/v1/rollouts/{rollout_id}/terminal", json={"response_id": last}, headers=AUTH
        )
        if answer.status_code == 409:  # a terminal was declared already
            assert answer.json()["error"]["code"] == "terminal_already_declared"
            return
        assert answer.status_code == 200, answer.text

    @rule(rollout_id=rollouts)
    def close(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        answer = self.http.post(
            f"/tokcap/v1/rollouts/{rollout_id}/close", json={"reward": 1.0}, headers=AUTH
        )
        if life.state != "open":
            assert answer.status_code in (404, 409), answer.text
            return
        if answer.status_code == 404:  # nothing was ever admitted under this id
            assert not life.answered
            return
        assert answer.status_code == 200, answer.text
        self._closed(rollout_id, life)

    @rule(rollout_id=rollouts)
    def release(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        answer = self.http.delete(f"/tokcap/v1/rollouts/{rollout_id}", headers=AUTH)
        if life.state == "closed":
            assert answer.status_code == 200, answer.text
            life.state = "released"
        else:
            assert answer.status_code in (404, 409), answer.text

    @rule(rollout_id=rollouts, raw=st.sampled_from(BAD_BODIES))
    def bad_body(self, rollout_id: str, raw: bytes) -> None:
        answer = self.http.post(
            self._url(rollout_id), content=raw, headers={"content-type": "application/json"}
        )
        assert 400 <= answer.status_code < 500, answer.text
        assert answer.json()["error"]["code"]

    # ---- hostile clients, part 2 (issue #24) ----------------------------------------

    @rule(rollout_id=rollouts, how=st.sampled_from(["empty", "long", "tab", "non_ascii"]))
    def bad_request_id(self, rollout_id: str, how: str) -> None:
        life = self.lives[rollout_id]
        body = self._body(life)
        headers = {}
        if how == "empty":
            headers = {"x-request-id": ""}
        elif how == "long":
            headers = {"x-request-id": "r" * 248}
        else:
            body["request_id"] = "a\tb" if how == "tab" else "caf\u00e9"
        answer = self.http.post(self._url(rollout_id), json=body, headers=headers)
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, "bad_request_id")

    @rule(
        rollout_id=rollouts,
        path=st.sampled_from(["/v1/embeddings", "/v1/messages/count_tokens"]),
    )
    def header_on_an_uncaptured_endpoint(self, rollout_id: str, path: str) -> None:
        answer = self.http.post(
            path,
            json={"model": self.server.model, "input": "x", "messages": [], "max_tokens": 2},
            headers={"x-tokcap-rollout-id": rollout_id},
        )
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "uncaptured_endpoint"

    @rule(rollout_id=rollouts)
    def deep_tool_arguments(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        body = self._body(life)
        deep = "[" * 5000 + "]" * 5000
        body["messages"] = [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "t", "type": "function", "function": {"name": "f", "arguments": deep}}
                ],
            },
            {"role": "tool", "tool_call_id": "t", "content": "y"},
        ]
        answer = self.http.post(self._url(rollout_id), json=body)
        expected = (409, "rollout_closed") if life.state == "closed" else (400, "bad_json")
        assert (answer.status_code, answer.json()["error"]["code"]) == expected

    @rule(rollout_id=rollouts)
    def close_while_generating(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        if life.state != "open":
            return
        body = self._body(life, stream=True, max_tokens=2000, ignore_eos=True)
        lines: list[str] = []
        with self.http.stream("POST", self._url(rollout_id), json=body) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                lines.append(line)
                if len(lines) == 1:
                    closed = self.http.post(
                        f"/tokcap/v1/rollouts/{rollout_id}/close", json={}, headers=AUTH
                    )
                    assert closed.status_code == 200, closed.text
        data = [line for line in lines if line.startswith("data: ")]
        assert "data: [DONE]" not in data  # never a normal end
        assert '"rollout_closed"' in data[-1], data[-1]
        self._closed(rollout_id, life)

    @rule(rollout_id=rollouts)
    def terminal_naming_no_call(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        answer = self.http.post(
            f"/tokcap/v1/rollouts/{rollout_id}/terminal", json={"call_id": "c999999"}, headers=AUTH
        )
        if life.state == "open" and life.answered:
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"]["code"] == "unknown_terminal"
        else:
            assert answer.status_code in (404, 409, 422), answer.text

    @rule(rollout_id=rollouts)
    def close_with_a_malformed_fingerprint(self, rollout_id: str) -> None:
        answer = self.http.post(
            f"/tokcap/v1/rollouts/{rollout_id}/close",
            json={"witnesses": {"content_fingerprint": "not-a-fingerprint"}},
            headers=AUTH,
        )
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["code"] == "bad_content_fingerprint"

    @rule(rollout_id=rollouts)
    def vllm_refuses(self, rollout_id: str) -> None:
        life = self.lives[rollout_id]
        answer = self.http.post(self._url(rollout_id), json=self._body(life, temperature=-1.0))
        assert 400 <= answer.status_code < 500, answer.text
        if life.state == "open" and not life.answered and not life.unanswered:  # nothing served
            assert rollout_id not in self.server.gate.rollouts()

    # ---- invariants ------------------------------------------------------------------

    def _committed(self, rollout_id: str) -> list[str]:
        try:
            ledger = self.server.gate.ledger(rollout_id)
        except KeyError:
            return []
        return [
            e.event.response_id or ""
            for e in ledger.entries
            if isinstance(e.event, Staged) and e.event.response_id
        ]

    def _last_committed(self, rollout_id: str) -> str | None:
        committed = self._committed(rollout_id)
        return committed[-1] if committed else None

    @invariant()
    def the_gate_serves(self) -> None:
        health = self.http.get("/tokcap/v1/health", headers=AUTH)
        assert health.status_code == 200, health.text
        assert health.json()["serving"] is True

    @invariant()
    def ledgers_hold_only_their_own_calls_and_one_call_per_key(self) -> None:
        for rollout_id, life in self.lives.items():
            if life.state == "released":
                continue
            committed = self._committed(rollout_id)
            assert set(committed) <= life.answered, (rollout_id, committed, life.answered)
            assert len(committed) == len(set(committed)), committed
            for response_id in life.keys.values():
                assert committed.count(response_id) <= 1

    @invariant()
    def admitted_calls_are_bounded_by_answers(self) -> None:
        for rollout_id, life in self.lives.items():
            if life.state == "released":
                continue
            try:
                entries = self.server.gate.ledger(rollout_id).entries
            except KeyError:
                continue
            staged = sum(isinstance(e.event, Staged) for e in entries)
            admitted = sum(isinstance(e.event, Admitted) for e in entries)
            assert staged <= len(life.answered) <= admitted, (rollout_id, staged, admitted)


def test_the_gate_keeps_its_invariants_under_any_sequence_of_calls(
    server: InProcessServer,
) -> None:
    global _SERVER
    _SERVER = server
    try:
        GateModel.TestCase.settings = settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        GateModel.TestCase().runTest()
    finally:
        _SERVER = None
