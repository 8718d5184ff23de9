"""The gate's I/O-free rules, one law at a time, with no engine: routing, completion parents,
message normalisation, staging refusals, the parent index and the claims of a call.

Each test pins a comparison the capture path depends on (`bench/mutate_gate.py` flips
them one at a time and counts how many of these tests notice).
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import pytest

from tests.vllm._rules import REQUEST, Flag, NoLock, admitted, result
from tokcap_core import Entry, TokcapError
from tokcap_core.ledger import Closed, Staged
from tokcap_core.provenance import VersionSpan
from tokcap_vllm.errors import (
    BadRequest,
    CallStateError,
    RolloutConflict,
    RolloutNotFound,
    TooManyRollouts,
)
from tokcap_vllm.fingerprints import message_fingerprints, normalize_message, output_fingerprint
from tokcap_vllm.gate._host import EngineResult
from tokcap_vllm.gate._lifecycle import Holder
from tokcap_vllm.gate._planning import Learned, Observed, ParentIndex, PlannedRequest
from tokcap_vllm.gate._planning._plan_text import ChatPlan, PriorCall, plan_completion
from tokcap_vllm.gate._planning._render_ids import (
    _served_message,
    _short_call_id,
    describe,
    is_id_tokenizer,
)
from tokcap_vllm.gate._planning._splice import _common_prefix, _ended, _lost, splice_cause
from tokcap_vllm.gate._records import (
    ABANDONED,
    ADMITTED,
    CLOSED,
    CLOSING,
    COMMITTED,
    CONTAINED,
    EMPTY,
    FAILED,
    OPEN,
    PLANNING,
    UNCAPTURED,
    GateCall,
    answerable,
    gone,
)
from tokcap_vllm.gate._rollouts import Abandon, RolloutBook, Settle
from tokcap_vllm.gate._routing import route_request
from tokcap_vllm.gate._staging import staged_call

PREFIX = "/tokcap/rollouts/"


def _book(max_open: int = 4) -> RolloutBook:
    return RolloutBook(max_open=max_open, flag=Flag, lock=NoLock)


def _route(path: str, headers: list[str] | None = None, method: str = "POST") -> Any:
    return route_request(path.encode(), path, method, headers or [], prefix=PREFIX)


# ---- routing -------------------------------------------------------------------------------


def test_a_rollout_path_routes_to_its_endpoint_and_a_trailing_slash_is_captured() -> None:
    route = _route(PREFIX + "r1/v1/chat/completions/")
    assert (route.rollout_id, route.path, route.endpoint) == ("r1", "/v1/chat/completions", "chat")
    route = _route(PREFIX + "r1/v1/completions?x=1")
    assert (route.path, route.endpoint) == ("/v1/completions", "completion")
    assert _route(PREFIX + "r1/v1/models", method="GET").endpoint is None


@pytest.mark.parametrize(
    ("path", "headers", "code"),
    [
        (PREFIX + "r1", [], "bad_rollout_path"),
        (PREFIX + "r1/v2/chat/completions", [], "bad_rollout_path"),
        (PREFIX + "..%2fx/v1/completions", [], "bad_rollout_id"),
        (PREFIX + "r1/v1/chat/completions", ["r2"], "conflicting_rollout_ids"),
        ("/v1/chat/completions", ["r1", "r1"], "bad_rollout_id"),
    ],
)
def test_a_malformed_or_ambiguous_rollout_request_is_refused(
    path: str, headers: list[str], code: str
) -> None:
    with pytest.raises(BadRequest) as e:
        _route(path, headers)
    assert e.value.code == code


def test_a_post_a_rollout_cannot_capture_is_refused_and_headers_route_plain_paths() -> None:
    with pytest.raises(RolloutNotFound) as e:
        _route(PREFIX + "r1/v1/embeddings")
    assert e.value.code == "uncaptured_endpoint"
    assert _route(PREFIX + "r1/v1/chat/completions", ["r1"]).rollout_id == "r1"
    route = _route("/v1/completions/", ["r3"])
    assert (route.rollout_id, route.path, route.endpoint) == ("r3", "/v1/completions", "completion")
    assert _route("/v1/models/", ["r3"], method="GET").path == "/v1/models/"
    plain = _route("/", method="GET")
    assert (plain.rollout_id, plain.path, plain.endpoint) == (None, "/", None)


# ---- completion parents ---------------------------------------------------------------------


def _prior(call_id: str, text: str, ids: list[int], kind: str = "completion") -> PriorCall:
    return PriorCall(call_id, kind, text, array("I", ids), gen_len=1)


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_completion_extends_the_longest_earlier_text_the_latest_of_equals() -> None:
    priors = [
        _prior("c1", "ab", [1, 2]),
        _prior("c2", "abc", [1, 2, 3]),
        _prior("c3", "abc", [7, 8, 9]),
        _prior("c4", "abcdef", [1]),
    ]
    plan = plan_completion("abcd", priors=priors, encode=_encode)
    assert (plan.parent_id, plan.prefix_len, plan.formation) == ("c3", 3, "extend")
    assert plan.prompt_ids == [7, 8, 9, ord("d")]
    assert plan.prompt_text == "abcd"


def test_a_completion_equal_to_an_earlier_text_or_after_only_chats_is_a_root() -> None:
    same = plan_completion("ab", priors=[_prior("c1", "ab", [1, 2])], encode=_encode)
    assert (same.parent_id, same.break_cause, same.prompt_ids) == (
        None,
        "no_parent_match",
        [97, 98],
    )
    chats = plan_completion("ab", priors=[_prior("c1", "a", [1], kind="chat")], encode=_encode)
    assert (chats.parent_id, chats.break_cause) == (None, None)
    first = plan_completion("ab", priors=[], encode=_encode)
    assert first.break_cause is None


def test_a_completion_of_ids_extends_the_longest_earlier_ids() -> None:
    priors = [_prior("c1", "", [1, 2]), _prior("c2", "", [1, 2, 3]), _prior("c3", "", [9])]
    plan = plan_completion([1, 2, 3, 4], priors=priors, encode=_encode)
    assert (plan.parent_id, plan.prefix_len, plan.prompt_ids) == ("c2", 3, [1, 2, 3, 4])
    assert plan.prompt_text == ""
    assert plan_completion([1, 2, 3], priors=priors, encode=_encode).parent_id == "c1"
    root = plan_completion([5], priors=priors, encode=_encode)
    assert (root.parent_id, root.prompt_ids) == (None, [5])


# ---- messages and fingerprints ----------------------------------------------------------------


def test_content_parts_are_joined_and_tool_calls_normalised() -> None:
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "a"}, "b"],
        "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": '{"q": 1}'}}],
        "tool_call_id": "t1",
        "name": 3,
    }
    assert normalize_message(message) == {
        "role": "assistant",
        "content": "a\nb",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"q": 1}}}],
        "tool_call_id": "t1",
    }
    raw = {"role": "user", "content": None, "tool_calls": [{"function": {"arguments": "{x"}}]}
    assert normalize_message(raw)["tool_calls"][0]["function"]["arguments"] == "{x"


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("text", "bad_body"),
        ({"role": 1}, "bad_body"),
        ({"role": "user", "content": [{"type": "image"}]}, "unsupported_content"),
        ({"role": "user", "content": [{"type": "text", "text": 1}]}, "unsupported_content"),
        ({"role": "user", "content": 3}, "bad_body"),
        ({"role": "user", "tool_calls": "f"}, "bad_body"),
        ({"role": "user", "tool_calls": [{"function": "f"}]}, "bad_body"),
    ],
)
def test_a_message_the_gate_cannot_read_is_refused(message: object, code: str) -> None:
    with pytest.raises(BadRequest) as e:
        normalize_message(message)
    assert e.value.code == code


def test_fingerprints_roll_and_an_output_fingerprint_covers_its_tool_calls() -> None:
    a, b = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    assert message_fingerprints([a, b])[0] == message_fingerprints([a])[0]
    assert message_fingerprints([a, b])[1] != message_fingerprints([b, b])[1]
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert output_fingerprint("x") == output_fingerprint("x", None) == output_fingerprint("x", [])
    assert output_fingerprint("x", calls) != output_fingerprint("x")
    assert output_fingerprint(None) == output_fingerprint("")


# ---- splicing helpers ---------------------------------------------------------------------------


def test_how_much_of_the_close_a_generation_already_ends_with() -> None:
    assert _ended("hi<|im_end|>\n", "<|im_end|>\n", ["<|im_end|>"]) == "<|im_end|>\n"
    assert _ended("hi<|im_end|>", "<|im_end|>\n", ["<|im_end|>", "<|im"]) == "<|im_end|>"
    assert _ended("hi", "<|im_end|>\n", ["<|im_end|>"]) == ""
    assert _ended("hi", "", []) == ""
    longer = ["<|im_end|>", "<|endoftext|>"]  # only a special text the close starts with counts
    assert _ended("hi<|im_end|>", "<|im_end|>\n", longer) == "<|im_end|>"
    assert _common_prefix("abcd", "abxd") == 2
    assert _common_prefix("ab", "ab") == 2
    assert _lost("<think>a", "a", ["<think>"])
    assert not _lost("<think>a", "<think>a", ["<think>"])


def test_splice_causes_in_their_order() -> None:
    def cause(generated: str, rendered: str, *, tool_calls: bool = False) -> str:
        return splice_cause(
            generated,
            rendered,
            markers=["<think>"],
            special_texts=["<s>", "<|x|>"],
            tool_calls=tool_calls,
        )

    assert cause("<think>a", "a") == "reasoning"
    assert cause("a<|x|>", "a") == "special_tokens"
    assert cause("a\ufffd", "a") == "invalid_utf8"
    assert cause("a b", "ab", tool_calls=True) == "tool_call_format"
    assert cause("a b", "ab") == "whitespace"
    assert cause("a", "b") == "other"


# ---- staging -----------------------------------------------------------------------------------


def _admitted_call(book: RolloutBook) -> GateCall:
    call = admitted(book, "st-1", kind="completion")
    assert call.call_id == "c000001"
    return call


def _result(**changes: Any) -> EngineResult:
    fields: dict[str, Any] = {
        "prompt_ids": [1, 2],
        "output_ids": array("I", [3, 4]),
        "logprobs": array("f", [-0.5, -0.25]),
        "finish_reason": "stop",
        "weight_version": 0,
        "weight_version_last": 0,
        "weight_versions": (VersionSpan(version=0, start=0, end=2),),
        "text": "xy",
    }
    return EngineResult(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "routes", "code"),
    [
        ({"finish_reason": "abort"}, False, "engine_incomplete"),
        ({"finish_reason": None}, False, "engine_incomplete"),
        ({"output_ids": array("I")}, False, "engine_incomplete"),
        ({"logprobs": array("f", [-0.5, math.nan])}, False, "bad_logprobs"),
        ({}, True, "routes_missing"),
    ],
)
def test_a_call_the_engine_did_not_finish_cleanly_is_not_staged(
    changes: dict[str, Any], routes: bool, code: str
) -> None:
    call = _admitted_call(_book())
    with pytest.raises(TokcapError) as e:
        staged_call(call, _result(**changes), routes)
    assert e.value.code == code


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_finished_call_is_staged_and_its_entry_commits_it(reason: str) -> None:
    call = _admitted_call(_book())
    staged = staged_call(call, _result(finish_reason=reason), False)
    assert (staged.call_id, staged.gen_len, staged.finish_reason) == ("c000001", 2, reason)
    entry = Staged.for_call(staged, response_id="resp-1", output_fingerprint="fp")
    assert (entry.call_digest, entry.chain_hash) == (staged.digest, staged.chain_hash)
    assert (entry.response_id, entry.output_fingerprint) == ("resp-1", "fp")


# ---- the parent index ----------------------------------------------------------------------------


def _request(messages: list[dict[str, Any]] | None) -> PlannedRequest:
    return PlannedRequest(messages, lambda priors, starts: ChatPlan(None, 0, [], ""), "".join)


def test_a_chat_call_leaves_its_exact_text_ids_and_conversation_for_its_children() -> None:
    user = normalize_message({"role": "user", "content": "hi"})
    request = PlannedRequest(
        [user], lambda p, s: ChatPlan(None, 0, [], ""), lambda ids: f"<{len(ids)}>"
    )
    seen = Observed("resp-1", "hello", None)
    learned = ParentIndex.learn(
        request,
        call_id="c000001",
        kind="chat",
        plan=ChatPlan(None, 0, [1, 2], "PROMPT"),
        result=_result(),
        seen=seen,
    )
    prior = learned.prior
    assert (prior.cum_text, list(prior.cum_ids), prior.gen_len) == ("PROMPT<2>", [1, 2, 3, 4], 2)
    turn = normalize_message({"role": "assistant", "content": "hello"})
    assert prior.conversation_fp == message_fingerprints([user, turn])[-1]
    assert learned.output_fp == output_fingerprint("hello")


def test_a_completion_call_leaves_its_text_only_when_its_prompt_was_text() -> None:
    def learn(prompt_text: str) -> PriorCall:
        return ParentIndex.learn(
            _request(None),
            call_id="c000001",
            kind="completion",
            plan=ChatPlan(None, 0, [1, 2], prompt_text),
            result=_result(),
            seen=Observed(None, "xy", None),
        ).prior

    assert learn("ab").cum_text == "abxy"
    assert learn("").cum_text == ""
    assert learn("ab").conversation_fp is None


def test_the_index_plans_over_the_parents_it_held_when_asked() -> None:
    index = ParentIndex()
    first, second = _prior("c1", "a", [1]), _prior("c2", "ab", [1, 2])
    index.add(first, 1)
    seen: list[Any] = []
    request = PlannedRequest(
        None, lambda p, s: seen.append((p, s)) or ChatPlan(None, 0, [], ""), "".join
    )
    plan = index.planner(request)
    index.add(second, 2)
    plan()
    assert seen == [([first], {"c1": 1})]
    index.forget(first)
    index.forget(first)
    assert index.snapshot() == ([second], {"c1": 1, "c2": 2})
    assert len(index) == 1
    assert second in index
    assert first not in index


# ---- rollouts and claims ----------------------------------------------------------------------


def test_the_open_bound_counts_only_open_records_and_a_dropped_request_leaves_none() -> None:
    book = _book(max_open=1)
    call = book.call_received("a", kind="chat")
    with pytest.raises(TooManyRollouts):
        book.call_received("b", kind="chat")
    book.call_dropped(call)
    assert book.records() == []
    assert book.join("b").phase is EMPTY


def test_a_key_holder_is_answered_again_waited_for_or_taken_over() -> None:
    book = _book()
    first = book.call_received("k", kind="chat", idempotency_key="key", body_fingerprint="b")
    assert book.call_claimed(first) is None
    retry = book.call_received("k", kind="chat", idempotency_key="key", body_fingerprint="b")
    assert book.call_claimed(retry) == Holder(first, None)  # still running: wait for it
    with pytest.raises(RolloutConflict) as e:
        book.call_claimed(retry, waited=first)  # waited, and it is still running
    assert e.value.code == "retry_in_flight"
    other = book.call_received("k", kind="chat", idempotency_key="key", body_fingerprint="c")
    with pytest.raises(RolloutConflict) as e:
        book.call_claimed(other)
    assert e.value.code == "idempotency_key_reused"
    first.phase = COMMITTED
    assert book.call_claimed(retry, waited=first) is None  # settled without an answer: taken over
    assert retry.rollout.keys["key"] is retry
    retry.phase, retry.answer = FAILED, ({}, [])
    assert answerable(retry)
    late = book.call_received("k", kind="chat", idempotency_key="key", body_fingerprint="b")
    assert book.call_claimed(late) == Holder(retry, ({}, []))  # its answer, sent again
    assert not gone(retry)


def test_a_request_id_names_one_call_of_a_rollout() -> None:
    book = _book()
    first = book.call_received("q", kind="chat", request_id="id-1")
    second = book.call_received("q", kind="chat", request_id="id-1")
    assert book.call_claimed(first) is None
    assert book.call_claimed(first) is None  # the same call again holds what it held
    with pytest.raises(RolloutConflict) as e:
        book.call_claimed(second)
    assert e.value.code == "duplicate_request_id"
    book.call_dropped(first)
    assert book.call_claimed(second) is None


def test_what_a_rollout_phase_lets_through() -> None:
    book = _book()
    record = book.join("p")
    assert (record.accepting, record.held) == (True, False)
    first = admitted(book, "p")
    assert (record.phase, record.held) == (OPEN, True)
    book.call_contained(first, "gate_failed:x")
    assert book.unpersisted(record, "ledger_write_failed:y") is False  # the first poison stays
    assert (first.phase, record.phase, record.poison) == (CONTAINED, UNCAPTURED, "gate_failed:x")
    with pytest.raises(RolloutConflict) as refused:  # a poisoned rollout refuses calls
        book.call_received("p", kind="chat")
    assert refused.value.code == "rollout_poisoned"
    assert book.close_requested("p") is record
    assert not record.accepting
    with pytest.raises(RolloutConflict):
        book.open_record("p")
    book.close_failed(record)
    assert (record.phase, book.open_record("p")) == (UNCAPTURED, record)
    fresh = admitted(book, "p2").rollout
    book.close_requested("p2")
    assert fresh.phase is CLOSING
    book.close_failed(fresh)
    assert fresh.phase is OPEN


def test_a_call_planned_on_a_parent_not_committed_waits_for_it() -> None:
    book = _book()
    parent = admitted(book, "w")
    assert book.call_finished(parent, result())
    parent.staged = staged_call(parent, result(), False)
    child = book.call_received("w", kind="chat")
    assert book.call_claimed(child) is None
    book.call_planning(child, REQUEST)
    cum = [1, 2, 3, 4, 5]
    on_parent = ChatPlan(
        "c000001", 5, [*cum, 6], "p+", request_fingerprint="fp", formation="extend"
    )
    entries = len(parent.rollout.ledger.entries)
    assert book.call_planned(child, on_parent, admitted_at=2, unserved=None) is parent
    assert (child.phase, len(parent.rollout.ledger.entries)) == (PLANNING, entries)
    with pytest.raises(RolloutConflict) as e:
        book.parent_waited(parent)
    assert e.value.code == "parent_not_committed"
    assert book.call_responded(parent, Observed("resp-1", None, None), None)
    assert book.call_committed(parent)[1] is None
    book.parent_waited(parent)  # committed: plan again
    admitted_entry = book.call_planned(child, on_parent, admitted_at=2, unserved=None)
    assert isinstance(admitted_entry, Entry)
    assert (child.phase, child.parent) == (ADMITTED, parent)


def test_a_close_abandons_the_calls_in_flight_then_waits_for_the_responded_ones() -> None:
    book = _book()
    generating, writing, responded = (admitted(book, "c") for _ in range(3))
    for call in (writing, responded):
        assert book.call_finished(call, result())
        call.staged = staged_call(call, result(), False)
    assert book.call_responded(responded, Observed("resp-3", None, None), None)
    record = book.close_requested("c")
    steps = []
    while (step := book.close_next(record)) is not None:
        steps.append(step)
        if isinstance(step, Abandon):
            abandoned = book.call_abandoned(step.call, "closed_in_flight")
            assert abandoned is not None
            assert abandoned.clear_row is (step.call is writing)  # its row was written
            assert abandoned.entry is not None
            assert abandoned.entry.event.reason == "uncommitted_call:closed_in_flight"  # type: ignore[attr-defined]
        else:
            assert book.call_committed(step.call)[1] is None
    assert {type(s) for s in steps[:2]} == {Abandon}
    assert {s.call for s in steps[:2]} == {generating, writing}
    assert steps[2:] == [Settle(responded)]
    entry = book.closed(record, reward=1.0, witnesses=None)
    assert isinstance(entry.event, Closed)
    assert (record.phase, generating.phase, responded.phase) == (CLOSED, ABANDONED, COMMITTED)
    assert generating.abandoned is not None
    assert generating.abandoned.is_set()  # its request is ended: vLLM stops generating it


def test_a_contained_call_is_never_answered_nor_committed_and_poisons_its_rollout() -> None:
    book = _book()
    call = admitted(book, "x", idempotency_key="key")
    assert book.call_finished(call, result())
    call.staged = staged_call(call, result(), False)
    book.call_contained(call, "gate_failed:Boom")
    assert (call.phase, call.final, call.settled.count) == (CONTAINED, True, 1)  # type: ignore[attr-defined]
    assert (call.rollout.phase, call.rollout.poison) == (UNCAPTURED, "gate_failed:Boom")
    refusal = book.call_completing(call)
    assert refusal is not None
    assert refusal.code == "rollout_poisoned"
    assert book.call_responded(call, Observed("r", None, None), None) is False  # ignored
    with pytest.raises(CallStateError):
        book.call_committed(call)
    book.call_contained(call, "gate_failed:again")  # settled: nothing more changes
    assert (call.phase, call.settled.count, call.rollout.poison) == (  # type: ignore[attr-defined]
        CONTAINED,
        1,
        "gate_failed:Boom",
    )
    assert call.rollout.keys["key"] is call  # kept: a retry under it takes it over


# ---- the id-level planner's small helpers -------------------------------------------------


def test_tool_call_ids_are_cut_to_their_last_nine_as_vllm_does() -> None:
    long_id, short_id = "call_0123456789", "abc"
    message = {
        "role": "assistant",
        "tool_calls": [{"id": long_id}, {"id": short_id}, "raw"],
        "tool_call_id": long_id,
    }
    served = _served_message(message)
    assert served["tool_calls"] == [{"id": long_id[-9:]}, {"id": short_id}, "raw"]
    assert served["tool_call_id"] == long_id[-9:]
    assert _served_message({"role": "tool", "tool_call_id": "123456789"})["tool_call_id"] == (
        "123456789"
    )
    assert _short_call_id({"id": "1234567890"}) == {"id": "234567890"}


def test_a_tokenizer_is_named_and_recognised_by_what_vllm_marks_it_with() -> None:
    class Plain:
        pass

    class Marked:
        IS_MISTRAL_TOKENIZER = True

    class Version:
        value = "v3"

    class Inner:
        version = Version()

    class Wrapped:
        tokenizer = Inner()

    assert not is_id_tokenizer(Plain())
    assert is_id_tokenizer(Marked())
    assert describe(Plain()) == "Plain"
    assert describe(Wrapped()) == "Wrapped (Inner v3)"


def test_a_parent_whose_call_fails_after_responding_is_a_parent_no_more() -> None:
    book = _book()
    calls = [admitted(book, "pf", kind="completion") for _ in (1, 2)]
    record = calls[0].rollout
    for call in calls:
        assert call.call_id is not None
        assert book.call_finished(call, result())
        call.staged = staged_call(call, result(), False)
        learned = Learned("fp", _prior(call.call_id, "abx", [1, 2]))
        assert book.call_responded(call, Observed(f"resp-{call.call_id}", None, None), learned)
    assert [p.call_id for p in record.parents.snapshot()[0]] == ["c000001", "c000002"]
    assert record.parents.snapshot()[1] == {"c000001": 6, "c000002": 6}  # len("prompt")
    calls[0].stage_error = "injected_put_failure"  # its sink write failed
    entry, refused = book.call_committed(calls[0])
    assert entry is not None
    assert (entry.event.served, refused) == (True, None)  # type: ignore[attr-defined]
    assert book.call_committed(calls[1])[1] is None
    assert [p.call_id for p in record.parents.snapshot()[0]] == ["c000002"]
    assert (record.phase, record.live) == (UNCAPTURED, set())
