"""Tamper cases for the reliability sweep (issue #9): every single change a gate or sink could make.

Each `Case` is one altered artifact plus the check a trainer would run on it; `judge` returns
its verdict:

- ``detected``: the check raised a typed `TokcapError` (its ``code`` feeds the histogram);
- ``refused``: a staged row that `StagedCall` itself refuses to build (typed error, counted
  as detected: a sink decoding that row raises the same error);
- ``equivalent``: a manifest byte change that decodes to the *same* manifest (it re-encodes
  to the original bytes, e.g. a 17-digit float whose last digit rounds back): not a tamper;
- ``miss``: anything else, i.e. an untyped exception or a different value silently accepted.

Manifest cases are checked as a trainer does: `decode_manifest` of the bytes, then
`verify_manifest` against the head kept at close. Staged-row cases: `verify_staged` and
`reassemble` against the receipt of the untampered manifest (``segments="all"``, so every
staged row lies on a segment); both must raise.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import struct
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from tokcap_core import (
    Entry,
    Manifest,
    Receipt,
    StagedCall,
    TokcapError,
    assemble_receipt,
    decode_manifest,
    reassemble,
    verify_manifest,
    verify_staged,
)
from tokcap_core.ledger import (
    FORMATIONS,
    SPLICE_CAUSES,
    Witnesses,
    chain_hash,
    encode_manifest,
    entry_hash,
    genesis_hash,
)
from tokcap_core.provenance import VersionSpan
from tokcap_core.routes import unknown_routes, widen
from tokcap_core.simulate import SimulatedRollout, simulate_rollout
from tokcap_core.staged import FINISH_REASONS

DETECTED: Final = "detected"
REFUSED: Final = "refused"
EQUIVALENT: Final = "equivalent"
MISS: Final = "miss"

MANIFEST_BYTE: Final = "manifest_byte"
MANIFEST_DROP: Final = "manifest_drop"
MANIFEST_REORDER: Final = "manifest_reorder"
MANIFEST_EVENT: Final = "manifest_event_rechained"
STAGED_TOKEN: Final = "staged_token"
STAGED_LOGPROB: Final = "staged_logprob"
STAGED_ROUTE: Final = "staged_route"
STAGED_FIELD: Final = "staged_field"
STAGED_FORGED: Final = "staged_forged"
STAGED_ROW: Final = "staged_row"
KINDS: Final = (
    MANIFEST_BYTE, MANIFEST_DROP, MANIFEST_REORDER, MANIFEST_EVENT, STAGED_TOKEN,
    STAGED_LOGPROB, STAGED_ROUTE, STAGED_FIELD, STAGED_FORGED, STAGED_ROW,
)  # fmt: skip

_MAX_SEQ_LEN: Final = 1 << 20
_HEX: Final = "0123456789abcdef"
_TERMINALS: Final = ("declared", "response_id", "content", "heuristic")
_TOPOLOGIES: Final = ((1, 0), (2, 1), (3, 2))  # (roots, off-chain failures)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A case's verdict and, when detected, the error code."""

    verdict: str
    code: str = ""


@dataclass(frozen=True, slots=True)
class Case:
    """One tampered artifact. ``check`` returns an `Outcome`, or None when it accepted it."""

    kind: str
    label: str
    check: Callable[[], Outcome | None]


def judge(case: Case) -> Outcome:
    """Run a case's check and classify what happened (see module docstring)."""
    try:
        outcome = case.check()
    except TokcapError as e:
        return Outcome(DETECTED, e.code)
    except Exception as e:  # any untyped exception is a finding, never a detection
        return Outcome(MISS, f"untyped {type(e).__name__}: {e}")
    return outcome if outcome is not None else Outcome(MISS, "accepted a different value")


# ---- scenarios -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scenario:
    """A closed synthetic rollout, its receipt and the head the trainer kept at close."""

    name: str
    sim: SimulatedRollout
    receipt: Receipt

    @property
    def head(self) -> tuple[int, str]:
        return self.sim.ledger.head


def scenarios(*, small: bool, seed: int = 0) -> Iterator[Scenario]:
    """An endless, deterministic cycle over terminal mode x routes x topology (24 combinations).

    ``small`` keeps rollouts short (2 turns, deltas <= 4 tokens) for the CI profile.
    """
    grid = itertools.product(_TERMINALS, (False, True), _TOPOLOGIES)
    for n, (terminal, routes, (roots, offchain)) in enumerate(itertools.cycle(grid)):
        rng = random.Random(f"{seed}/{n}")
        turns = 2 if small else rng.randint(1, 4)
        sim = simulate_rollout(
            f"tamper-{n}",
            seed=rng.getrandbits(32),
            turns=turns,
            roots=roots,
            offchain_failures=offchain,
            terminal=terminal,  # type: ignore[arg-type]
            routes=routes,
            reward=rng.choice([None, 1.0, -0.25, rng.uniform(-10, 10)]),
            max_delta=4 if small else 24,
        )
        receipt = assemble_receipt(verify_manifest(sim.manifest), segments="all")
        if not receipt.ok:
            raise AssertionError(f"scenario {n} is not a verified rollout: {receipt}")
        name = f"{terminal} routes={int(routes)} roots={roots} offchain={offchain} turns={turns}"
        yield Scenario(name=name, sim=sim, receipt=receipt)


def cases_for(
    sc: Scenario, *, replacements: int = 3, byte_stride: int = 1, byte_offset: int = 0
) -> Iterator[Case]:
    """Every tamper case of one scenario, lazily (see `manifest_byte_cases` for the options)."""
    yield from manifest_byte_cases(
        sc, replacements=replacements, stride=byte_stride, offset=byte_offset
    )
    yield from manifest_entry_cases(sc)
    yield from manifest_event_cases(sc)
    yield from staged_cases(sc)


# ---- manifest cases --------------------------------------------------------------------------


def _replacement_bytes(byte: int, rng: random.Random, count: int) -> list[int]:
    char = chr(byte)
    if char in _HEX:
        same_class = _HEX[(_HEX.index(char) + 1) % 16]
    elif char.isalpha():
        alphabet = "abcdefghijklmnopqrstuvwxyz"
        same_class = alphabet[(alphabet.index(char.lower()) + 1) % 26]
        same_class = same_class.upper() if char.isupper() else same_class
    else:
        same_class = rng.choice([c for c in '{}[]:,"-.+eE0 ' if c != char])
    candidates = [byte ^ 1, ord(same_class), rng.choice([b for b in range(256) if b != byte])]
    return list(dict.fromkeys(candidates))[:count]


def manifest_byte_cases(
    sc: Scenario, *, replacements: int = 3, stride: int = 1, offset: int = 0
) -> Iterator[Case]:
    """Every byte position of the encoded manifest x up to ``replacements`` other bytes
    (low bit flipped, another character of the same class, a random byte).

    ``stride > 1`` takes every ``stride``-th position from ``offset`` (the CI profile rotates
    the offset across scenarios, so the positions mod ``stride`` are all covered).
    """
    original = encode_manifest(sc.sim.manifest)
    rng = random.Random(original[:64] + original[-64:])
    for pos in range(offset % stride, len(original), stride):
        byte = original[pos]
        for new in _replacement_bytes(byte, rng, replacements):
            data = original[:pos] + bytes([new]) + original[pos + 1 :]
            yield Case(
                MANIFEST_BYTE,
                f"{sc.name}: byte {pos} {byte:#04x}->{new:#04x}",
                _manifest_check(data, original, sc.head),
            )


def _manifest_check(
    data: bytes, original: bytes, head: tuple[int, str]
) -> Callable[[], Outcome | None]:
    def check() -> Outcome | None:
        manifest = decode_manifest(data)
        if encode_manifest(manifest) == original:
            return Outcome(EQUIVALENT)
        verify_manifest(manifest, expected_head=head)
        return None

    return check


def rechain(rollout_id: str, events: list[Any]) -> tuple[Entry, ...]:
    """Entries with fresh seqs, links and hashes: what a gate rewriting history would serve."""
    entries: list[Entry] = []
    prev = genesis_hash(rollout_id)
    for seq, event in enumerate(events, start=1):
        entry = Entry(seq=seq, event=event, prev_hash=prev, hash=entry_hash(prev, event))
        entries.append(entry)
        prev = entry.hash
    return tuple(entries)


def _served(sc: Scenario, entries: tuple[Entry, ...], variant: str) -> Manifest:
    """The manifest a gate serves with ``entries``: head kept, moved to the last entry, or both
    rechained and moved (the strongest forger: only the head kept at close stops it)."""
    m = sc.sim.manifest
    if variant == "rechained":
        entries = rechain(m.rollout_id, [e.event for e in entries])
    if variant == "raw" or not entries:
        return dataclasses.replace(m, entries=entries)
    return dataclasses.replace(
        m, entries=entries, head_seq=entries[-1].seq, head_hash=entries[-1].hash
    )


def _object_check(manifest: Manifest, head: tuple[int, str]) -> Callable[[], Outcome | None]:
    return _manifest_check(encode_manifest(manifest), b"", head)


def manifest_entry_cases(sc: Scenario) -> Iterator[Case]:
    """Every dropped entry and every swapped entry pair, each served raw, head-moved, rechained."""
    entries = sc.sim.manifest.entries
    for variant in ("raw", "head_moved", "rechained"):
        for i in range(len(entries)):
            kept = entries[:i] + entries[i + 1 :]
            yield Case(
                MANIFEST_DROP,
                f"{sc.name}: drop entry {i + 1} ({variant})",
                _object_check(_served(sc, kept, variant), sc.head),
            )
        for i, j in itertools.combinations(range(len(entries)), 2):
            swapped = list(entries)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            yield Case(
                MANIFEST_REORDER,
                f"{sc.name}: swap entries {i + 1},{j + 1} ({variant})",
                _object_check(_served(sc, tuple(swapped), variant), sc.head),
            )


def _field_alternatives(name: str, value: object) -> list[object]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1] + ([value - 1] if value > 0 else [])
    if isinstance(value, float):
        return [value + 1.0, None]
    if isinstance(value, Witnesses):
        forged = Witnesses(response_id="forged", content_fingerprint=value.content_fingerprint)
        return [w for w in (Witnesses(), forged) if w != value]
    if name in ("weight_versions", "kv_versions"):
        return _span_alternatives(value)
    if value is None:
        return [
            {
                "parent_id": "c000001",
                "break_cause": "no_parent_match",
                "splice_cause": "whitespace",
                "reward": 0.5,
            }.get(name, "forged")
        ]
    assert isinstance(value, str)
    if name == "finish_reason":
        return [r for r in FINISH_REASONS if r != value]
    if name == "by":
        return ["response_id" if value == "call_id" else "call_id"]
    if name == "formation":
        return [f for f in FORMATIONS if f != value]
    if name == "splice_cause":
        return [next(c for c in SPLICE_CAUSES if c != value), None]
    if len(value) == 64 and set(value) <= set(_HEX):
        return [_HEX[(_HEX.index(value[0]) + 1) % 16] + value[1:]]
    alternatives: list[object] = [value + "x"]
    if name in ("call_id", "parent_id", "value") and value.startswith("c"):
        alternatives = [f"c{int(value[1:]) + 1:06d}"]
    if name in ("parent_id", "break_cause", "response_id", "output_fingerprint"):
        alternatives.append(None)
    return alternatives


def _span_alternatives(value: object) -> list[object]:
    """Format v3 provenance forged: stripped (a v2 entry), a version moved, a span cut short."""
    if value is None:
        return [(VersionSpan(version=0, start=0, end=1),)]
    assert isinstance(value, tuple)
    first, rest = value[0], value[1:]
    moved = (VersionSpan(version=first.version + 1, start=first.start, end=first.end), *rest)
    alternatives: list[object] = [None, moved]
    if first.length > 1:
        alternatives.append(
            (VersionSpan(version=first.version, start=first.start, end=first.end - 1), *rest)
        )
    return alternatives


def manifest_event_cases(sc: Scenario) -> Iterator[Case]:
    """Every field of every event changed, the whole history rechained and its head moved."""
    events = [e.event for e in sc.sim.manifest.entries]
    for i, event in enumerate(events):
        for f in dataclasses.fields(event):
            for alt in _field_alternatives(f.name, getattr(event, f.name)):
                label = f"{sc.name}: entry {i + 1} {event.KIND}.{f.name}={alt!r} (rechained)"
                yield Case(MANIFEST_EVENT, label, _event_check(sc, events, i, f.name, alt))


def _event_check(
    sc: Scenario, events: list[Any], index: int, name: str, alt: object
) -> Callable[[], Outcome | None]:
    def check() -> Outcome | None:
        try:
            changed = dataclasses.replace(events[index], **{name: alt})
        except TokcapError as e:  # the decoder builds events the same way: it would refuse too
            return Outcome(REFUSED, e.code)
        forged = rechain(
            sc.sim.manifest.rollout_id, [*events[:index], changed, *events[index + 1 :]]
        )
        return _object_check(_served(sc, forged, "head_moved"), sc.head)()

    return check


# ---- staged-row cases ------------------------------------------------------------------------


def _f32_neighbour(x: float) -> float:
    """The next f32 away from zero: the smallest change a logprob can undergo."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    (y,) = struct.unpack("<f", struct.pack("<I", bits + 1))
    return float(y)


def _staged_check(
    sc: Scenario, key: str, build: Callable[[], StagedCall | None]
) -> Callable[[], Outcome | None]:
    """Check ``sc``'s rows with the row at ``key`` replaced by ``build()`` (None: dropped)."""

    def check() -> Outcome | None:
        rows = dict(sc.sim.staged)
        try:
            tampered = build()
        except TokcapError as e:
            return Outcome(REFUSED, e.code)
        if tampered is None:
            del rows[key]
        else:
            rows[key] = tampered
        try:
            verify_staged(sc.receipt, rows)
        except TokcapError:
            reassemble(sc.receipt, rows, max_seq_len=_MAX_SEQ_LEN)  # must raise as well
            return None
        return None

    return check


def _replaced(call: StagedCall, **changes: Any) -> Callable[[], StagedCall]:
    return lambda: dataclasses.replace(call, **changes)


def _field_changes(call: StagedCall, parent_chain: str | None) -> Iterator[tuple[str, Any]]:
    other_id = f"c{int(call.call_id[1:]) + 1:06d}"
    yield "rollout_id", {"rollout_id": call.rollout_id + "x"}
    yield "call_id", {"call_id": other_id}
    yield "parent_id", {"parent_id": None if call.parent_id else "c000001"}
    if call.parent_id is not None:
        yield "parent_id", {"parent_id": other_id}
    for name in ("prefix_len", "carry_len", "gen_len", "weight_version", "weight_version_last"):
        value = getattr(call, name)
        yield f"{name}+1", {name: value + 1}
        if value > 0:
            yield f"{name}-1", {name: value - 1}
    yield (
        "finish_reason",
        {"finish_reason": next(r for r in FINISH_REASONS if r != call.finish_reason)},
    )
    for name in ("digest", "chain_hash"):
        value = getattr(call, name)
        for pos in (0, 63):
            flipped = _HEX[(_HEX.index(value[pos]) + 1) % 16]
            yield f"{name}[{pos}]", {name: value[:pos] + flipped + value[pos + 1 :]}
    if call.routes is None:
        rows = call.route_rows
        yield "routes added", {"routes": unknown_routes(rows, layers=2, topk=2, dtype="int16")}
    else:
        yield "routes dropped", {"routes": None}
        yield "routes widened", {"routes": widen(call.routes, "int32")}
    yield "tokens truncated", {"tokens": call.tokens[:-1]}
    yield "logprobs truncated", {"logprobs": call.logprobs[:-1]}
    unlinked = chain_hash(None if parent_chain else call.digest, call.digest)
    yield "chain_hash relinked", {"chain_hash": unlinked}


def _forge(call: StagedCall, parent_chain: str | None, **changes: Any) -> Callable[[], StagedCall]:
    """A row changed *and* re-digested (digest and chain hash recomputed to match)."""

    def build() -> StagedCall:
        changed = dataclasses.replace(call, **changes)
        digest = changed.compute_digest()
        return dataclasses.replace(
            changed, digest=digest, chain_hash=chain_hash(parent_chain, digest)
        )

    return build


def staged_cases(sc: Scenario) -> Iterator[Case]:
    """Every token, logprob and route value; every field; re-digested forgeries; dropped and
    substituted rows, for every row on the receipt's segments."""
    on_chain = [(link, prev) for seg in sc.receipt.segments for prev, link in _with_previous(seg)]
    for link, prev in on_chain:
        key = link.staging_key
        call = sc.sim.staged[key]
        parent_chain = prev.chain_hash if prev is not None else None
        where = f"{sc.name}: {call.call_id}"
        for i, token in enumerate(call.tokens):
            for new in (token ^ 1, token ^ (1 << 31)):
                tokens = array("I", call.tokens)
                tokens[i] = new
                label = f"{where} token[{i}] {token}->{new}"
                yield Case(
                    STAGED_TOKEN, label, _staged_check(sc, key, _replaced(call, tokens=tokens))
                )
        for i, lp in enumerate(call.logprobs):
            for new in (_f32_neighbour(lp), -lp if lp else -1.0):
                logprobs = array("f", call.logprobs)
                logprobs[i] = new
                label = f"{where} logprob[{i}] {lp!r}->{new!r}"
                yield Case(
                    STAGED_LOGPROB,
                    label,
                    _staged_check(sc, key, _replaced(call, logprobs=logprobs)),
                )
        if call.routes is not None:
            for i, v in enumerate(call.routes.data):
                for new in ((v + 1) % 8 if v >= 0 else 0, -1 if v >= 0 else 7):
                    data = array(call.routes.data.typecode, call.routes.data)
                    data[i] = new
                    routes = dataclasses.replace(call.routes, data=data)
                    label = f"{where} routes[{i}] {v}->{new}"
                    yield Case(
                        STAGED_ROUTE, label, _staged_check(sc, key, _replaced(call, routes=routes))
                    )
        for name, changes in _field_changes(call, parent_chain):
            yield Case(
                STAGED_FIELD, f"{where} {name}", _staged_check(sc, key, _replaced(call, **changes))
            )
        tokens = array("I", call.tokens)
        tokens[-1] ^= 1
        logprobs = array("f", call.logprobs)
        logprobs[0] = _f32_neighbour(logprobs[0])
        forgeries: dict[str, dict[str, Any]] = {
            "token": {"tokens": tokens},
            "logprob": {"logprobs": logprobs},
            "weight_version": {"weight_version": call.weight_version + 1},
            "weight_version_last": {"weight_version_last": call.weight_version_last + 1},
            "finish_reason": {
                "finish_reason": next(r for r in FINISH_REASONS if r != call.finish_reason)
            },
        }
        if call.routes is not None:
            forgeries["routes dropped"] = {"routes": None}
        for name, changes in forgeries.items():
            yield Case(
                STAGED_FORGED,
                f"{where} {name} re-digested",
                _staged_check(sc, key, _forge(call, parent_chain, **changes)),
            )
        yield Case(STAGED_ROW, f"{where} dropped", _staged_check(sc, key, lambda: None))
        for other, _ in on_chain:
            if other.staging_key != key:
                substitute = sc.sim.staged[other.staging_key]
                label = f"{where} replaced by {other.call_id}"
                yield Case(STAGED_ROW, label, _staged_check(sc, key, lambda s=substitute: s))


def _with_previous(segment: tuple[Any, ...]) -> Iterator[tuple[Any, Any]]:
    previous = None
    for link in segment:
        yield previous, link
        previous = link


# ---- the sweep -------------------------------------------------------------------------------


@dataclass
class KindStats:
    """Verdict counts and error-code histogram of one case kind."""

    verdicts: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)

    @property
    def cases(self) -> int:
        return sum(self.verdicts.values())


@dataclass
class SweepReport:
    """What a sweep measured: per-kind stats, misses (label, detail), scenarios and time."""

    kinds: dict[str, KindStats] = field(default_factory=lambda: {k: KindStats() for k in KINDS})
    misses: list[tuple[str, str]] = field(default_factory=list)
    scenarios: int = 0
    seconds: float = 0.0

    @property
    def cases(self) -> int:
        return sum(s.cases for s in self.kinds.values())

    @property
    def miss_count(self) -> int:
        return sum(s.verdicts[MISS] for s in self.kinds.values())


def sweep(
    min_cases: int,
    *,
    small: bool,
    min_scenarios: int = 24,
    replacements: int = 3,
    byte_stride: int = 1,
    seed: int = 0,
    progress: Callable[[SweepReport], None] | None = None,
) -> SweepReport:
    """Run whole scenarios until at least ``min_cases`` cases and ``min_scenarios`` scenarios."""
    report = SweepReport()
    start = time.perf_counter()
    for sc in scenarios(small=small, seed=seed):
        if report.cases >= min_cases and report.scenarios >= min_scenarios:
            break
        cases = cases_for(
            sc, replacements=replacements, byte_stride=byte_stride, byte_offset=report.scenarios
        )
        for case in cases:
            outcome = judge(case)
            stats = report.kinds[case.kind]
            stats.verdicts[outcome.verdict] += 1
            if outcome.verdict in (DETECTED, REFUSED):
                stats.codes[outcome.code] += 1
            elif outcome.verdict == MISS:
                report.misses.append((case.label, outcome.code))
        report.scenarios += 1
        report.seconds = time.perf_counter() - start
        if progress is not None:
            progress(report)
    report.seconds = time.perf_counter() - start
    return report
