"""The conformance kit (`tokcap_core.testing`): tokcap's own parts pass it, and it can fail.

The broken sinks below are faults injected on purpose (subclasses of MemorySink that
break one rule each); a kit that let them through would prove nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import Phase, settings

from tests.core.interop.gymkit import capture_json, worked_example
from tests.core.interop.tamper_rules import GYM_DEFAULTS, IRRELEVANT, RESELECTED
from tokcap_core import (
    MemorySink,
    StagedCall,
    TokcapError,
    TokenSink,
    TrainingRow,
    assemble_receipt,
    decode_manifest,
    verify_manifest,
)
from tokcap_core.ids import TrainingKey
from tokcap_core.interop import gym
from tokcap_core.ledger import encode_manifest
from tokcap_core.simulate import simulate_rollout
from tokcap_core.staged import encode_staged_calls
from tokcap_core.testing import (
    SINK_CHECKS,
    SinkConformance,
    check_capture_format,
    check_clears,
    check_concurrency,
    check_conflicting_puts,
    check_idempotent_puts,
    check_media,
    check_strict_gets,
    check_training_rows,
    cli_verifier,
    golden_samples,
)


class TestMemorySinkConforms(SinkConformance):
    """tokcap's reference sink passes every check of the kit."""

    async def make_sink(self) -> TokenSink:
        return MemorySink()


# ---- faults injected on purpose: each breaks one rule of the TokenSink contract ----------


class DroppingSink(MemorySink):
    """FAULT INJECTED: get/fetch silently drop missing keys (returns fewer rows)."""

    async def get(self, keys: Sequence[str]) -> list[StagedCall]:
        held = set(await self.staged_keys())
        return await super().get([k for k in keys if k in held])  # type: ignore[misc]

    async def fetch(self, keys: Sequence[str]) -> list[TrainingRow]:
        held = set(await self.row_keys())
        return await super().fetch([k for k in keys if k in held])  # type: ignore[misc]


class OverwritingSink(MemorySink):
    """FAULT INJECTED: a conflicting put overwrites what is held (last writer wins)."""

    async def put(self, calls: Sequence[StagedCall]) -> None:
        await self.clear([c.key for c in calls])
        await super().put(calls)


class HalfStoringSink(MemorySink):
    """FAULT INJECTED: a refused batch keeps the calls stored before the conflict."""

    async def put(self, calls: Sequence[StagedCall]) -> None:
        for call in calls:
            await super().put([call])


class StrictClearSink(MemorySink):
    """FAULT INJECTED: clearing an absent key raises (a retried clear is unsafe)."""

    async def clear(self, keys: Sequence[str]) -> None:
        held = set(await self.staged_keys())
        if any(k not in held for k in keys):
            raise TokcapError("missing_rows", "cannot clear what is not held")
        await super().clear(keys)  # type: ignore[arg-type]


class ForgetfulRowSink(MemorySink):
    """FAULT INJECTED: training rows are republished over held ones without a check."""

    async def publish(self, rows: Mapping[TrainingKey, TrainingRow]) -> None:
        await self.clear_rows(list(rows))
        await super().publish(rows)


class DuplicatingSink(MemorySink):
    """FAULT INJECTED: a retried put is stored again under a second key."""

    async def put(self, calls: Sequence[StagedCall]) -> None:
        held = set(await self.staged_keys())
        await super().put(calls)
        for call in calls:
            if call.key in held:
                self._staged[call.key + "-dup"] = call  # type: ignore[index]


class SharedBufferSink(MemorySink):
    """FAULT INJECTED: put parks its batch in one buffer shared by every caller across an
    await, so concurrent puts store each other's calls."""

    _buffer: Sequence[StagedCall] = ()

    async def put(self, calls: Sequence[StagedCall]) -> None:
        import asyncio

        type(self)._buffer = calls
        await asyncio.sleep(0)
        await super().put(type(self)._buffer)


class OverwritingMediaSink(MemorySink):
    """FAULT INJECTED: a different blob under a held digest replaces it (last writer wins)."""

    async def put_media(self, blobs: Mapping[str, bytes]) -> None:
        await self.clear_media(list(blobs))
        await super().put_media(blobs)


class LeakyMediaSink(MemorySink):
    """FAULT INJECTED: clear_media forgets nothing."""

    async def clear_media(self, digests: Sequence[str]) -> None:
        return None


@pytest.fixture
def no_shrinking() -> Iterator[None]:
    """The kit's hypothesis runs stop at the first failing example, unshrunk: a broken sink
    fails either way, and shrinking its example was nearly all of these tests' time (160 s
    for the eight on a loaded 2-core box, under 1 s without)."""
    previous = settings.get_current_profile_name()
    settings.register_profile(
        "tokcap-no-shrinking",
        parent=settings.get_profile(previous),
        phases=[phase for phase in Phase if phase is not Phase.shrink],
    )
    settings.load_profile("tokcap-no-shrinking")
    try:
        yield
    finally:
        settings.load_profile(previous)


def factory(cls: type[MemorySink]) -> Any:
    async def make() -> TokenSink:
        return cls()

    return make


@pytest.mark.parametrize(
    ("sink", "check"),
    [
        (DroppingSink, check_strict_gets),
        (DroppingSink, check_training_rows),
        (OverwritingSink, check_conflicting_puts),
        (HalfStoringSink, check_conflicting_puts),
        (StrictClearSink, check_clears),
        (ForgetfulRowSink, check_training_rows),
        (DuplicatingSink, check_idempotent_puts),
        (SharedBufferSink, check_concurrency),
        (OverwritingMediaSink, check_media),
        (LeakyMediaSink, check_media),
    ],
)
def test_a_broken_sink_fails_the_kit(
    sink: type[MemorySink], check: Any, no_shrinking: None
) -> None:
    # a broken rule shows as the kit's AssertionError or as the sink's own error escaping
    with pytest.raises((AssertionError, TokcapError)):
        check(factory(sink), max_examples=20)


def test_the_kit_names_every_check() -> None:
    assert set(SINK_CHECKS) == {
        name.removeprefix("test_") for name in dir(SinkConformance) if name.startswith("test_")
    }


# ---- the format kit -------------------------------------------------------------------


def sample_of(rollout_id: str, seed: int, **kw: Any) -> tuple[bytes, bytes]:
    rollout = simulate_rollout(rollout_id, seed=seed, **kw)
    return encode_manifest(rollout.manifest), encode_staged_calls(rollout.calls)


def forest_sample() -> tuple[bytes, bytes]:
    """A simulated gate's forest: two roots, an off-chain failure, a heuristic terminal."""
    return sample_of("gate-b", 2, turns=2, roots=2, offchain_failures=1, terminal="heuristic")


HARMLESS = {"an identical staged call listed twice", "a poisoned receipt reads no staged row"}
"""Changes a verifier may let through: they leave the result as it was."""


def test_tokcaps_golden_rollouts_and_simulated_gates_pass_the_format_kit() -> None:
    samples = [*golden_samples(), sample_of("gate-a", 1, turns=3, routes=True), forest_sample()]
    report = check_capture_format(samples)
    assert report.samples == len(samples)
    assert report.detected > 1000
    # golden-b is a forest whose receipt names both roots' chains; only a sink's extra
    # rows can change unseen, and they leave the result as it was
    assert set(report.irrelevant) <= {"staged call outside every receipt segment", *HARMLESS}


@pytest.mark.slow
def test_the_cli_default_passes_the_format_kit() -> None:
    """``tokcap-core verify`` with its default options, run in process on every sample."""
    report = check_capture_format([*golden_samples(), forest_sample()], verify=cli_verifier())
    assert report.detected > 1000
    outside = "staged call outside every receipt segment (result changed)"
    assert set(report.irrelevant) <= {outside, *HARMLESS}


@pytest.mark.slow
def test_the_console_script_passes_the_format_kit() -> None:
    """The command line itself, one process per change, on the smallest golden rollout."""
    smallest = min(golden_samples(), key=lambda s: len(s[0]) + len(s[1]))
    report = check_capture_format(
        [smallest], verify=cli_verifier([sys.executable, "-m", "tokcap_core", "verify"])
    )
    assert report.detected > 100


def test_a_cli_that_exits_0_on_a_tamper_fails_the_format_kit() -> None:
    """FAULT INJECTED: a command that prints a verified-looking report whatever it reads."""
    liar = [sys.executable, "-c", "import json; print(json.dumps({'receipt': 'ok'}))"]
    with pytest.raises(AssertionError, match="undetected change"):
        check_capture_format(golden_samples()[-1:], verify=cli_verifier(liar))


def test_a_verifier_that_skips_staged_rows_fails_the_format_kit() -> None:
    """FAULT INJECTED: a verifier that never checks digests of staged rows."""

    def lax(manifest: bytes, staged: bytes) -> object:
        return assemble_receipt(verify_manifest(decode_manifest(manifest))).to_json()

    with pytest.raises(AssertionError, match="undetected change of document 1"):
        check_capture_format(golden_samples()[:1], verify=lax)


def test_a_gate_whose_samples_do_not_verify_fails_the_format_kit() -> None:
    """FAULT INJECTED: a gate that writes its staged rows with another rollout's calls."""
    manifest, _ = sample_of("gate-c", 3)
    _, other = sample_of("gate-d", 4)
    with pytest.raises(AssertionError, match="does not verify"):
        check_capture_format([(manifest, other)])


# ---- the Gym reader through the same format kit ---------------------------------------


def verify_gym_sample(receipt: bytes, snapshots: bytes) -> object:
    """Gym's two documents through tokcap's Gym reader; a poisoned rollout is a refusal."""
    parsed = gym.decode_gym_receipt(receipt)
    result = gym.verify_gym_rollout(parsed, gym.decode_gym_snapshots(snapshots))
    if not result.ok:
        raise gym.GymVerificationError("poisoned", result.gym_reason or "")
    row = result.row
    return (row.input_ids.tolist(), row.loss_mask.tolist(), row.logprobs.tobytes(),
            row.call_spans, row.routes, row.terminal_call_id, row.reward)  # fmt: skip


def gym_irrelevant(document: int, path: tuple[Any, ...], sample: tuple[bytes, bytes]) -> str | None:
    field = next((p for p in reversed(path) if isinstance(p, str) and not p.startswith("<")), "")
    doc = json.loads(sample[document])
    if path[-1] == "<removed>":
        node = doc
        for step in path[:-1]:
            node = node[step]
        if field in GYM_DEFAULTS and node == GYM_DEFAULTS[field]:
            return "a key removed that holds Gym's default"
    if document == 0 and field in IRRELEVANT:
        return IRRELEVANT[field]
    if document == 0 and field in RESELECTED:
        return "terminal re-selected"
    return None


def test_the_gym_reader_passes_the_format_kit() -> None:
    captures = [worked_example(), worked_example("g7_r1", selection="heuristic", schema_version=3)]
    samples = [
        (gym.encode_gym_json(c.receipt), gym.encode_gym_json(list(c.snapshots))) for c in captures
    ]
    report = check_capture_format(samples, verify=verify_gym_sample, irrelevant=gym_irrelevant)
    assert report.detected > 200
    changed = {r for r in report.irrelevant if r.endswith("(result changed)")}
    assert changed <= {
        f"{IRRELEVANT['reward']} (result changed)",
        "terminal re-selected (result changed)",
    }
    assert capture_json(captures[0])[0]["terminal_selection"] == "declared"
