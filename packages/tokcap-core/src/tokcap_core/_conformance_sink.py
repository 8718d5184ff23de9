"""The sink conformance kit: property-based checks any `TokenSink` must pass.

Each ``check_*`` takes an async factory that returns a *fresh, empty* sink and runs a
hypothesis property over synthetic staged calls and training rows, one fresh sink per
example, on asyncio (``asyncio.run``; structured concurrency with ``asyncio.TaskGroup``).
A violation raises AssertionError (hypothesis shrinks it first). `SinkConformance` wraps
every check as a pytest test method. The contract checked is `TokenSink`'s:
- ``get``/``fetch`` return every key in the order asked, or raise `MissingRows` naming
  exactly the absent keys: never fewer rows;
- a put of different content under a held key raises `SinkError` ``conflicting_put`` and
  stores nothing of its batch; an identical put is a no-op;
- clears ignore absent keys and may be retried; cleared keys read as missing;
- training rows follow the same rules, and a row offered under another key is refused;
- concurrent puts, gets and clears of different rollouts do not interfere;
- media blobs (`MediaStore`, `check_media`) follow the same rules, keyed by digest, and
  come back bit for bit (a sink that holds no images sets ``SinkConformance.media`` False).
Importing this module imports hypothesis (the ``testing`` extra).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeAlias

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ._errors import MissingRows, SinkError
from ._media import tensors_digest
from ._media_blob import media_blob
from ._reassembly import reassemble
from ._receipt import assemble_receipt
from ._rows import TrainingRow, placeholder_row
from ._staged import StagedCall
from .ids import StagingKey, TrainingKey
from .simulate import SimulatedRollout, simulate_rollout
from .sink import MediaStore, TokenSink, fetch_media

__all__ = [
    "SINK_CHECKS",
    "SinkConformance",
    "SinkFactory",
    "check_clears",
    "check_concurrency",
    "check_conflicting_puts",
    "check_idempotent_puts",
    "check_media",
    "check_put_get_round_trip",
    "check_strict_gets",
    "check_training_rows",
]

_STRANGER = TrainingKey("someone-else/s000")
SinkFactory: TypeAlias = Callable[[], Awaitable[TokenSink]]
"""An async callable returning a fresh, empty sink."""


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def _run(factory: SinkFactory, body: Callable[[TokenSink], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        await body(await factory())

    asyncio.run(main())


@st.composite
def _rollouts(draw: Any, *, count: int = 3, routes: bool | None = None) -> list[SimulatedRollout]:
    """Distinct synthetic rollouts (chains, forests, routes or not)."""
    out = []
    for index in range(draw(st.integers(1, count))):
        out.append(
            simulate_rollout(
                f"conf{index}-{draw(st.integers(0, 9999))}",
                seed=draw(st.integers(0, 2**32 - 1)),
                turns=draw(st.integers(1, 3)),
                roots=draw(st.integers(1, 2)),
                terminal=draw(st.sampled_from(["declared", "heuristic"])),
                routes=draw(st.booleans()) if routes is None else routes,
                max_delta=draw(st.integers(1, 12)),
            )
        )
    return out


def _calls(rollouts: Sequence[SimulatedRollout]) -> list[StagedCall]:
    return [call for rollout in rollouts for call in rollout.calls]


def _rows(rollouts: Sequence[SimulatedRollout]) -> list[TrainingRow]:
    rows: list[TrainingRow] = []
    for rollout in rollouts:
        receipt = assemble_receipt(rollout.ledger.state, segments="all")
        if receipt.ok:
            rows.extend(reassemble(receipt, rollout.calls, max_seq_len=1 << 20))
        else:
            rows.append(placeholder_row(receipt.rollout_id, receipt.failure_reason or "unknown"))
    return rows


async def _missing(read: Awaitable[object]) -> tuple[str, ...]:
    """The keys a read reports missing; AssertionError if it returned rows instead."""
    try:
        got = await read
    except MissingRows as e:
        return e.missing
    raise AssertionError(f"a read of absent keys returned {type(got).__name__} instead of raising")


async def _refusal(op: Awaitable[object], what: str) -> str:
    """The code of the `SinkError` ``op`` raises; AssertionError if it succeeds."""
    try:
        await op
    except SinkError as e:
        return e.code
    raise AssertionError(f"{what} was accepted")


def check_put_get_round_trip(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """What is put comes back equal, in the order asked, digests intact."""

    @_settings(max_examples)
    @given(_rollouts(), st.randoms(use_true_random=False))
    def prop(rollouts: list[SimulatedRollout], rng: Any) -> None:
        calls = _calls(rollouts)
        order = list(calls)
        rng.shuffle(order)

        async def body(sink: TokenSink) -> None:
            await sink.put(calls)
            got = await sink.get([c.key for c in order])
            assert got == order, "get must return the stored calls in the order asked"
            assert all(c.compute_digest() == c.digest for c in got), "a digest changed in storage"
            assert await sink.get([]) == [], "get([]) must return []"

        _run(factory, body)

    prop()


def check_strict_gets(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """A get naming absent keys raises `MissingRows` naming exactly those: never fewer rows."""

    @_settings(max_examples)
    @given(_rollouts(routes=False), st.data())
    def prop(rollouts: list[SimulatedRollout], data: Any) -> None:
        calls = _calls(rollouts)
        stored = data.draw(st.lists(st.sampled_from(calls), unique_by=lambda c: c.key))
        absent = [c.key for c in calls if c not in stored] + [StagingKey("nowhere/c999999")]
        asked = data.draw(st.permutations([c.key for c in stored] + absent))

        async def body(sink: TokenSink) -> None:
            await sink.put(stored)
            missing = await _missing(sink.get(asked))
            assert set(missing) == set(absent), f"missing {missing!r}, expected {absent!r}"
            assert len(missing) == len(set(missing)), "missing keys are named once"

        _run(factory, body)

    prop()


def check_conflicting_puts(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """Different content under a held key is refused (``conflicting_put``), nothing stored."""

    @_settings(max_examples)
    @given(_rollouts(count=2), st.data())
    def prop(rollouts: list[SimulatedRollout], data: Any) -> None:
        calls = _calls(rollouts)
        held = data.draw(st.integers(1, len(calls)))
        first, rest = calls[:held], calls[held:]
        victim = data.draw(st.sampled_from(first))
        changed = dataclasses.replace(
            victim, finish_reason="length" if victim.finish_reason == "stop" else "stop"
        )

        async def body(sink: TokenSink) -> None:
            await sink.put(first)
            code = await _refusal(sink.put([*rest, changed]), "a conflicting put")
            assert code == "conflicting_put", f"conflict code {code!r}"
            assert await sink.get([c.key for c in first]) == first, "a held call was overwritten"
            if rest:
                missing = await _missing(sink.get([c.key for c in rest]))
                assert set(missing) == {c.key for c in rest}, "a refused batch was partly stored"

        _run(factory, body)

    prop()


def check_idempotent_puts(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """Putting identical calls again (a retry) changes nothing and raises nothing."""

    @_settings(max_examples)
    @given(_rollouts())
    def prop(rollouts: list[SimulatedRollout]) -> None:
        calls = _calls(rollouts)

        async def body(sink: TokenSink) -> None:
            await sink.put(calls)
            await sink.put(calls)
            await sink.put(calls[: len(calls) // 2])
            assert await sink.get([c.key for c in calls]) == calls, "a retried put changed rows"
            keys = await sink.staged_keys()
            assert sorted(keys) == sorted(c.key for c in calls), "staged_keys after a retry"

        _run(factory, body)

    prop()


def check_clears(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """Clears free keys, ignore absent ones and may be retried; cleared keys read as missing."""

    @_settings(max_examples)
    @given(_rollouts(), st.data())
    def prop(rollouts: list[SimulatedRollout], data: Any) -> None:
        calls = _calls(rollouts)
        gone = data.draw(st.lists(st.sampled_from(calls), unique_by=lambda c: c.key))
        kept = [c for c in calls if c not in gone]

        async def body(sink: TokenSink) -> None:
            await sink.clear([StagingKey("nowhere/c000001")])
            await sink.put(calls)
            await sink.clear([c.key for c in gone] + [StagingKey("nowhere/c000002")])
            await sink.clear([c.key for c in gone])
            assert await sink.get([c.key for c in kept]) == kept, "a clear freed other keys"
            if gone:
                missing = await _missing(sink.get([c.key for c in calls]))
                assert set(missing) == {c.key for c in gone}, "cleared keys must read as missing"
            await sink.clear([c.key for c in calls])
            assert not set(await sink.staged_keys()) & {c.key for c in calls}, "a clear leaked"

        _run(factory, body)

    prop()


def check_training_rows(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """publish/fetch/clear_rows keep the staging rules; a row under another key is refused."""

    @_settings(max_examples)
    @given(_rollouts())
    def prop(rollouts: list[SimulatedRollout]) -> None:
        rows = {row.key: row for row in _rows(rollouts)}
        keys = list(rows)

        async def body(sink: TokenSink) -> None:
            await sink.publish(rows)
            await sink.publish(rows)
            assert await sink.fetch(keys[::-1]) == [rows[k] for k in keys[::-1]], "fetch order"
            first = rows[keys[0]]
            changed = dataclasses.replace(first, reward=(first.reward or 0.0) + 1.0)
            code = await _refusal(sink.publish({keys[0]: changed}), "a conflicting publish")
            assert code == "conflicting_put", f"conflict code {code!r}"
            code = await _refusal(sink.publish({_STRANGER: first}), "a row under another key")
            assert code == "key_mismatch", f"key mismatch code {code!r}"
            missing = await _missing(sink.fetch([*keys, _STRANGER]))
            assert set(missing) == {_STRANGER}, f"missing {missing!r}"
            await sink.clear_rows([keys[0], TrainingKey("nowhere/s000")])
            await sink.clear_rows([keys[0]])
            assert set(await _missing(sink.fetch(keys))) == {keys[0]}, "clear_rows"
            await sink.clear_rows(keys)
            assert not set(await sink.row_keys()) & set(keys), "clear_rows leaked"

        _run(factory, body)

    prop()


def check_concurrency(factory: SinkFactory, *, max_examples: int = 5) -> None:
    """Concurrent puts, gets and clears of different rollouts never see each other's rows.

    Rounds of 2 to 12 rollouts at once, one task each (deterministic: no shrinking, so a
    race shows the same way every run).
    """
    for round_ in range(max_examples):
        count = 2 + (round_ * 5) % 11
        rollouts = [
            simulate_rollout(f"conc{i}", seed=round_ * 100 + i, turns=3, routes=i % 2 == 0)
            for i in range(count)
        ]

        async def life(sink: TokenSink, rollout: SimulatedRollout) -> None:
            keys = [c.key for c in rollout.calls]
            await sink.put(rollout.calls)
            assert await sink.get(keys) == rollout.calls, "a concurrent get saw other rows"
            await sink.clear(keys)
            assert set(await _missing(sink.get(keys))) == set(keys), "a concurrent clear"

        async def body(sink: TokenSink, rollouts: list[SimulatedRollout] = rollouts) -> None:
            try:
                async with asyncio.TaskGroup() as tg:
                    for rollout in rollouts:
                        tg.create_task(life(sink, rollout))
            except ExceptionGroup as group:
                first = group.exceptions[0]
                raise AssertionError(f"concurrent rollouts interfered: {first!r}") from group
            left = set(await sink.staged_keys())
            assert not left & {c.key for r in rollouts for c in r.calls}, "rows leaked"

        _run(factory, body)


@st.composite
def _blobs(draw: Any) -> dict[str, bytes]:
    """Distinct media blobs by their tensors digest (random pixel-like tensors)."""
    out = {}
    for _ in range(draw(st.integers(1, 4))):
        data = draw(st.binary(min_size=1, max_size=64))
        tensors = [("pixel_values", "uint8", (len(data),), data)]
        if draw(st.booleans()):
            tensors.append(("image_sizes", "int64", (2,), bytes(range(16))))
        out[tensors_digest(tensors)] = media_blob(tensors)
    return out


def check_media(factory: SinkFactory, *, max_examples: int = 10) -> None:
    """Media blobs: stored once by digest, read back bit for bit and verified, an identical
    re-put a no-op, a different blob under a held digest refused with nothing of its batch
    stored, absent digests missing, clears retryable, `MediaStore.media_keys` exact."""

    @_settings(max_examples)
    @given(_blobs(), _blobs())
    def prop(blobs: dict[str, bytes], others: dict[str, bytes]) -> None:
        others = {k: v for k, v in others.items() if k not in blobs}

        async def body(sink: TokenSink) -> None:
            assert isinstance(sink, MediaStore), "the sink is not a MediaStore"
            keys = list(blobs)
            await sink.put_media(blobs)
            await sink.put_media(blobs)
            assert await sink.get_media(keys[::-1]) == [blobs[k] for k in keys[::-1]]
            assert set(await fetch_media(sink, keys)) == set(keys)
            assert sorted(await sink.media_keys()) == sorted(keys), "media_keys after a re-put"
            if others:
                assert set(await _missing(sink.get_media([*keys, *others]))) == set(others)
                tampered = {**others, keys[0]: blobs[keys[0]] + b"x"}
                code = await _refusal(sink.put_media(tampered), "a conflicting media put")
                assert code == "conflicting_put", code
                assert sorted(await sink.media_keys()) == sorted(keys), "a refused put stored"
            await sink.clear_media([*keys, *others])
            await sink.clear_media(keys)
            assert not await sink.media_keys(), "clear_media leaked"
            assert set(await _missing(sink.get_media(keys))) == set(keys)

        _run(factory, body)

    prop()


SINK_CHECKS: dict[str, Callable[..., None]] = {
    "put_get_round_trip": check_put_get_round_trip,
    "strict_gets": check_strict_gets,
    "conflicting_puts": check_conflicting_puts,
    "idempotent_puts": check_idempotent_puts,
    "clears": check_clears,
    "training_rows": check_training_rows,
    "concurrency": check_concurrency,
    "media": check_media,
}
"""Every sink check by name (each takes ``(factory, *, max_examples=...)``)."""


class SinkConformance:
    """Every sink check as a pytest test: subclass as ``Test...`` and define ``make_sink``.

    ``make_sink`` is an ``async`` method returning a fresh, empty sink (it is called once
    per hypothesis example). ``max_examples`` sets how many examples each check runs.
    """

    max_examples: ClassVar[int] = 10
    media: ClassVar[bool] = True
    """Whether the sink holds images (a `MediaStore`); False skips `check_media`."""

    async def make_sink(self) -> TokenSink:
        """A fresh, empty sink under test."""
        raise NotImplementedError("define `async def make_sink(self)` in your test class")

    def test_put_get_round_trip(self) -> None:
        """What is put comes back equal and in order."""
        check_put_get_round_trip(self.make_sink, max_examples=self.max_examples)

    def test_strict_gets(self) -> None:
        """Absent keys raise MissingRows naming exactly them."""
        check_strict_gets(self.make_sink, max_examples=self.max_examples)

    def test_conflicting_puts(self) -> None:
        """A conflicting put is refused and stores nothing."""
        check_conflicting_puts(self.make_sink, max_examples=self.max_examples)

    def test_idempotent_puts(self) -> None:
        """An identical put is a no-op."""
        check_idempotent_puts(self.make_sink, max_examples=self.max_examples)

    def test_clears(self) -> None:
        """Clears ignore absent keys and may be retried."""
        check_clears(self.make_sink, max_examples=self.max_examples)

    def test_training_rows(self) -> None:
        """Training rows follow the same rules."""
        check_training_rows(self.make_sink, max_examples=self.max_examples)

    def test_concurrency(self) -> None:
        """Concurrent rollouts do not interfere."""
        check_concurrency(self.make_sink, max_examples=max(1, self.max_examples // 2))

    def test_media(self) -> None:
        """Media blobs are stored once by digest under the same rules."""
        if self.media:
            check_media(self.make_sink, max_examples=self.max_examples)
