"""Who may reach what, with no engine: the rollout a request names, the route table, owners.

A rollout id the core does not accept is refused (``bad_rollout_id``) with the core's reason.
The route table (`tokcap_vllm.control._route_table`) answers every path vLLM mounts as public,
guarded (the control token) or refused (403 even with it); a path it does not name is
guarded. Paths are compared after the server's root path, doubled slashes and a trailing
slash are taken off; a template's ``{name}`` matches one non-empty segment.

The owners (`tokcap_vllm.gate._rollouts.Owners`): a rollout opened with an owner token is
that owner's;
anyone else is refused (``rollout_owned``) while the owner keeps talking, and takes it over
once the owner has been silent for longer than the lease.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokcap_vllm.control._route_table import normalized_path, route_listing, rule_of
from tokcap_vllm.errors import BadRequest, RolloutConflict
from tokcap_vllm.gate._rollouts import Owners
from tokcap_vllm.gate._routing import parse_rollout_id

# ---- the route table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "root", "normal"),
    [
        ("/v1//models/", "", "/v1/models"),
        ("/api/v1/models", "/api", "/v1/models"),
        ("/api/v1/models", "", "/api/v1/models"),
        ("/v1/models", "/api", "/v1/models"),  # not under the root path: kept
        ("///", "", "/"),
        ("/api", "/api", "/"),
    ],
)
def test_a_path_is_compared_without_root_path_doubled_or_trailing_slashes(
    path: str, root: str, normal: str
) -> None:
    assert normalized_path(path, root) == normal


@pytest.mark.parametrize(
    ("path", "access"),
    [
        ("/v1/chat/completions", "public"),
        ("/v1/responses/resp_1", "public"),
        ("/v1/responses/resp_1/cancel", "public"),
        ("/v1/responses/resp_1/other", "guarded"),  # a segment more than the template
        ("/v1/responses//cancel", "guarded"),  # a template segment matches no empty one
        ("/v1/responses/{response_id}", "public"),  # the template itself, as listed
        ("/metrics/anything", "public"),  # under a mounted app
        ("/metricsx", "guarded"),
        ("/update_weights", "guarded"),
        ("/collective_rpc", "refused"),  # refused, though among the guarded names too
        ("/adapters/a1", "refused"),
        ("/adapters", "refused"),
        ("/adapters/a1/x", "guarded"),
        ("/v1/load_lora_adapter", "refused"),
        ("/something/new", "guarded"),
    ],
)
def test_every_path_is_public_guarded_or_refused_and_an_unknown_one_guarded(
    path: str, access: str
) -> None:
    assert rule_of(path).access == access


def test_only_a_path_the_table_does_not_name_is_unlisted() -> None:
    assert not rule_of("/something/new").listed
    assert rule_of("/update_weights").listed
    assert rule_of("/health").reason.startswith("liveness")


def test_a_listing_gives_each_route_its_methods_and_rule() -> None:
    routes: list[Any] = [
        SimpleNamespace(path="/v1/models/", methods={"HEAD", "GET"}),
        SimpleNamespace(path="/metrics", methods=None),  # a mounted app has no methods
        SimpleNamespace(name="no path"),
    ]
    listing = route_listing(routes)
    assert [(path, methods, rule.access) for path, methods, rule in listing] == [
        ("/v1/models/", ["GET", "HEAD"], "public"),
        ("/metrics", [], "public"),
    ]


# ---- the rollout a request names ---------------------------------------------------------------


def test_a_malformed_rollout_id_is_refused_with_the_cores_reason() -> None:
    assert parse_rollout_id("r-1") == "r-1"
    with pytest.raises(BadRequest) as refused:
        parse_rollout_id("../x")
    assert (refused.value.code, refused.value.message) == (
        "bad_rollout_id",
        "not a rollout id: '../x'",
    )


# ---- owners ------------------------------------------------------------------------------------

R1: Any = "r1"  # a rollout id as the control plane validated it


def _owned(lease_s: float = 10.0) -> Owners:
    owners = Owners(lease_s=lease_s)
    owners.touch("a", 0.0)
    owners.hold(R1, "a")
    return owners


def _refused(owners: Owners, owner: str | None, now: float) -> bool:
    """Whether ``owner`` is refused ``r1`` at ``now`` (the refusal is ``rollout_owned``)."""
    try:
        owners.check(R1, owner, now)
    except RolloutConflict as e:
        refusal: str | None = e.code
    else:
        refusal = None
    assert refusal in (None, "rollout_owned")
    return refusal is not None


def test_an_unowned_rollout_is_anyones() -> None:
    owners = Owners(lease_s=10.0)
    for asker in ("b", None):
        assert not _refused(owners, asker, 100.0)
    owners.hold(R1, None)  # opened without an owner
    assert owners.of(R1) is None
    assert not _refused(owners, "b", 100.0)


def test_a_rollout_is_taken_from_an_owner_silent_past_the_lease_and_not_at_it() -> None:
    owners = _owned()
    assert _refused(owners, "b", 10.0)  # silent for exactly the lease: still a's
    assert not _refused(owners, "a", 10.0)
    assert (owners.of(R1), owners.takeovers) == ("a", 0)
    assert not _refused(owners, "b", 10.5)
    assert (owners.of(R1), owners.takeovers) == ("b", 1)


def test_an_owner_that_talks_keeps_its_rollout_and_a_late_clock_does_not_rewind_it() -> None:
    owners = _owned()
    owners.touch("a", 8.0)
    owners.touch("a", 3.0)  # an older request answered late
    owners.touch(None, 50.0)  # an unsigned request renews nobody
    assert _refused(owners, "b", 17.5)
    assert _refused(owners, None, 17.5)
    owners.forget(R1)
    assert not _refused(owners, "b", 17.5)
