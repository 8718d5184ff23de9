"""The RPC contract between a trainer and the reassembler pool: metadata only, never tokens.

A `ReassemblyRequest` names a group's rollouts, their receipts and rewards; a
`FinalizedGroup` says what the pool published and which sink keys it holds. Both
validate in their constructor and pass `assert_metadata_only`, so a token tensor, a
buffer or a field called ``input_ids`` can never ride along by accident. A test pins
each class's exact field set: a new field must be classified as metadata first.
"""

from __future__ import annotations

import inspect
import math
from array import array
from dataclasses import dataclass, fields, is_dataclass
from typing import Final, Literal, TypeAlias

from ._errors import InvalidId, MetadataViolation, TokcapError
from ._receipt import Receipt
from ._staged import StagedCall
from .ids import StagingKey, TrainingKey, validate_rollout_id
from .routes import Routes

__all__ = [
    "FORBIDDEN_KEYS",
    "MAX_METADATA_DEPTH",
    "FinalizedGroup",
    "InvalidRequest",
    "ReassemblyRequest",
    "assert_metadata_only",
]

FORBIDDEN_KEYS: Final[frozenset[str]] = frozenset(
    {
        "input_ids",
        "tokens",
        "token_ids",
        "logprobs",
        "routes",
        "routed_experts",
        "loss_mask",
        "prompt_token_ids",
        "output_token_ids",
        "attention_mask",
    }
)
"""Dict keys and field names that name token data; none may appear in an RPC payload."""
MAX_METADATA_DEPTH: Final = 64
"""Deepest nesting `assert_metadata_only` walks (a cycle also ends here)."""

_ARRAYISH: Final = ("__array__", "__array_interface__", "__dlpack__", "__cuda_array_interface__")
_TOKEN_TYPES: Final = (StagedCall, Routes)
_MISSING: Final = object()


class InvalidRequest(TokcapError, ValueError):
    """An RPC record's fields break one of its invariants (the caller built it wrong)."""


def assert_metadata_only(obj: object) -> None:
    """Raise `MetadataViolation` unless ``obj`` is plain metadata at every depth.

    Allowed: ``str``/``int``/``float``/``bool``/``None`` (exact types: a numpy scalar is
    refused, convert it with ``float()``), and dataclasses, dicts, lists, tuples and sets
    of them. Codes: ``tensor_value`` (buffers, arrays, tensors, `StagedCall`, `Routes`,
    any ``TrainingRow``), ``forbidden_key`` (a name in `FORBIDDEN_KEYS`),
    ``unsupported_type`` (anything else), ``too_deep`` (over `MAX_METADATA_DEPTH`).
    The message names the path, e.g. ``receipts[0].segments[1][2]``.
    """
    _walk(obj, None, 0)


_Path: TypeAlias = "tuple[_Path, str] | None"
"""A path as a cons list ``(parent, segment)``; rendered only when a violation is raised."""


def _render(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, segment = path
        parts.append(str(segment))
    text = "".join(reversed(parts)).lstrip(".")
    return text or "<root>"


def _walk(obj: object, path: _Path, depth: int) -> None:
    if depth > MAX_METADATA_DEPTH:
        raise MetadataViolation(
            "too_deep", f"nested over {MAX_METADATA_DEPTH} deep at {_render(path)}"
        )
    kind = _kind(obj)
    if kind == "plain":
        return
    if kind == "token":
        raise MetadataViolation(
            "tensor_value", f"{type(obj).__name__} at {_render(path)} holds tokens"
        )
    if kind == "dataclass":
        for name in _field_names(type(obj), path):
            _walk(getattr(obj, name), (path, f".{name}"), depth + 1)
    elif kind == "dict":
        assert isinstance(obj, dict)
        for key, value in obj.items():
            here = (path, f"[{key!r}]")
            if isinstance(key, str):
                _check_name(key, here)
            _walk(key, here, depth + 1)
            _walk(value, here, depth + 1)
    elif kind == "sequence":
        assert isinstance(obj, (list, tuple))
        for name in getattr(obj, "_fields", ()):  # a namedtuple's field names are keys too
            _check_name(name, (path, f".{name}"))
        for i, item in enumerate(obj):
            _walk(item, (path, f"[{i}]"), depth + 1)
    elif kind == "set":
        assert isinstance(obj, (set, frozenset))
        for item in obj:
            _walk(item, (path, "{...}"), depth + 1)
    else:
        raise MetadataViolation("unsupported_type", f"{type(obj).__qualname__} at {_render(path)}")


_KINDS: dict[type, str] = {t: "plain" for t in (str, int, float, bool, type(None))}
_FIELDS: dict[type, tuple[str, ...]] = {}


def _kind(obj: object) -> str:
    """Classify ``obj`` by its type (cached: what holds tokens is a property of the type)."""
    tp = type(obj)
    kind = _KINDS.get(tp)
    if kind is None:
        if _is_token_data(obj):
            kind = "token"
        elif is_dataclass(obj) and not isinstance(obj, type):
            kind = "dataclass"
        elif isinstance(obj, dict):
            kind = "dict"
        elif isinstance(obj, (list, tuple)):
            kind = "sequence"
        elif isinstance(obj, (set, frozenset)):
            kind = "set"
        else:
            kind = "unsupported"
        _KINDS[tp] = kind
    return kind


def _field_names(tp: type, path: _Path) -> tuple[str, ...]:
    names = _FIELDS.get(tp)
    if names is None:
        names = tuple(f.name for f in fields(tp))
        for name in names:
            _check_name(name, (path, f".{name}"))
        _FIELDS[tp] = names
    return names


def _is_token_data(obj: object) -> bool:
    if isinstance(obj, (bytes, bytearray, memoryview, array, *_TOKEN_TYPES)):
        return True
    if any(cls.__name__ == "TrainingRow" for cls in type(obj).__mro__):
        return True
    if any(inspect.getattr_static(obj, name, _MISSING) is not _MISSING for name in _ARRAYISH):
        return True
    try:
        with memoryview(obj):  # type: ignore[arg-type]
            return True
    except TypeError:
        return False


def _check_name(name: str, path: _Path) -> None:
    if name in FORBIDDEN_KEYS:
        raise MetadataViolation("forbidden_key", f"{name!r} names token data at {_render(path)}")


def _require(ok: bool, code: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(code, message)


def _check_group_id(group_id: object) -> None:
    try:
        validate_rollout_id(group_id)
    except InvalidId as e:
        raise InvalidId("bad_group_id", f"not a group id: {group_id!r}") from e


def _check_rollout_ids(rollout_ids: object) -> tuple[str, ...]:
    if not isinstance(rollout_ids, tuple) or not rollout_ids:
        raise InvalidRequest("bad_rollout_ids", "rollout_ids must be a non-empty tuple")
    for rollout_id in rollout_ids:
        validate_rollout_id(rollout_id)
    _require(len(set(rollout_ids)) == len(rollout_ids), "duplicate_rollout_id", "ids repeat")
    return rollout_ids


def _check_version(name: str, value: object) -> None:
    ok = value is None or (type(value) is int and value >= 0)
    _require(ok, "bad_field", f"{name} must be an int >= 0 or None")


def _check_unique_keys(name: str, keys: tuple[str, ...]) -> None:
    ok = isinstance(keys, tuple) and all(type(k) is str and k for k in keys)
    _require(ok, "bad_field", f"{name} must be a tuple of non-empty strings")
    _require(len(set(keys)) == len(keys), "duplicate_key", f"{name} repeats a key")


def _is_finite(value: object) -> bool:
    """An int or float (not a bool, not a numpy scalar) that is finite."""
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReassemblyRequest:
    """Reassemble one group: its rollouts' receipts and the trainer's rewards (no tokens).

    ``receipts[i]`` and ``rewards[i]`` belong to ``rollout_ids[i]``; a reward that is not
    None overrides ``receipts[i].reward``. Codes: ``bad_group_id`` (`InvalidId`),
    ``bad_rollout_ids``, ``duplicate_rollout_id``, ``length_mismatch``,
    ``receipt_mismatch``, ``bad_reward``, ``bad_max_seq_len``, ``bad_field``
    (`InvalidRequest`), and `MetadataViolation` codes.
    """

    group_id: str
    rollout_ids: tuple[str, ...]
    receipts: tuple[Receipt, ...]
    rewards: tuple[float | None, ...]
    max_seq_len: int
    clear_staging: bool = True

    def __post_init__(self) -> None:
        _check_group_id(self.group_id)
        n = len(_check_rollout_ids(self.rollout_ids))
        receipts, rewards = self.receipts, self.rewards
        ok = isinstance(receipts, tuple) and isinstance(rewards, tuple)
        _require(ok, "bad_field", "receipts and rewards must be tuples")
        ok = len(receipts) == n and len(rewards) == n
        _require(
            ok, "length_mismatch", f"{n} ids, {len(receipts)} receipts, {len(rewards)} rewards"
        )
        for i, (rollout_id, receipt) in enumerate(zip(self.rollout_ids, receipts, strict=True)):
            ok = isinstance(receipt, Receipt) and receipt.rollout_id == rollout_id
            _require(ok, "receipt_mismatch", f"receipts[{i}] is not the receipt of {rollout_id!r}")
        for i, reward in enumerate(rewards):
            ok = reward is None or _is_finite(reward)
            _require(ok, "bad_reward", f"rewards[{i}] must be a finite float or None: {reward!r}")
        ok = type(self.max_seq_len) is int and self.max_seq_len >= 1
        _require(ok, "bad_max_seq_len", f"max_seq_len must be an int >= 1: {self.max_seq_len!r}")
        _require(type(self.clear_staging) is bool, "bad_field", "clear_staging must be a bool")
        assert_metadata_only(self)

    @property
    def staging_keys(self) -> tuple[StagingKey, ...]:
        """Every admitted call's staging key (on-chain or not), receipt by receipt."""
        return tuple(key for receipt in self.receipts for key in receipt.sink_keys)


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalizedGroup:
    """What the pool did with a group: rows published, sink keys held, failures, metrics.

    ``outcome="unknown"``: the pool cannot know whether it published (an actor died
    mid-request); the keys are the ones to check, never a guess, and the row-count and
    weight-version laws of a published group are not enforced. ``metrics`` is copied on
    construction and must not be mutated. Codes (`InvalidRequest`): ``bad_rollout_ids``,
    ``duplicate_rollout_id``, ``duplicate_key``, ``bad_counts``, ``bad_weight_versions``,
    ``bad_failure``, ``bad_metric``, ``bad_outcome``, ``bad_field``.
    """

    group_id: str
    rollout_ids: tuple[str, ...]
    valid_row_count: int
    total_row_count: int
    training_keys: tuple[TrainingKey, ...]
    """One key per published row, placeholders included."""
    staging_keys: tuple[StagingKey, ...]
    staging_cleared: bool
    """Whether the reassembler already cleared ``staging_keys``."""
    weight_version_min: int | None
    weight_version_max: int | None
    """Bounds over valid rows; both None when no row is valid."""
    failures: tuple[tuple[str, str], ...]
    """``(rollout_id, reason)`` of each invalid rollout."""
    metrics: dict[str, float]
    outcome: Literal["published", "unknown"] = "published"

    def __post_init__(self) -> None:
        _check_group_id(self.group_id)
        rollout_ids = set(_check_rollout_ids(self.rollout_ids))
        _check_unique_keys("training_keys", self.training_keys)
        _check_unique_keys("staging_keys", self.staging_keys)
        _require(self.outcome in ("published", "unknown"), "bad_outcome", repr(self.outcome))
        _require(type(self.staging_cleared) is bool, "bad_field", "staging_cleared must be a bool")
        published = self.outcome == "published"
        valid, total = self.valid_row_count, self.total_row_count
        ok = type(valid) is int and type(total) is int and 0 <= valid <= total
        _require(
            ok, "bad_counts", f"need 0 <= valid_row_count <= total_row_count: {valid}, {total}"
        )
        ok = total == len(self.training_keys)
        _require(ok, "bad_counts", f"{total} rows, {len(self.training_keys)} training keys")
        ok = not published or total >= len(rollout_ids)
        _require(ok, "bad_counts", "every rollout publishes at least one row")
        self._check_weight_versions(published)
        self._check_failures(rollout_ids)
        ok = not published or total - valid >= len(self.failures)
        _require(ok, "bad_counts", "every failed rollout publishes at least one placeholder row")
        ok = isinstance(self.metrics, dict)
        ok = ok and all(type(k) is str and _is_finite(v) for k, v in self.metrics.items())
        _require(ok, "bad_metric", "metrics must map str to finite floats")
        object.__setattr__(self, "metrics", dict(self.metrics))
        assert_metadata_only(self)

    def _check_weight_versions(self, published: bool) -> None:
        low, high = self.weight_version_min, self.weight_version_max
        _check_version("weight_version_min", low)
        _check_version("weight_version_max", high)
        ok = (low is None and high is None) or (
            low is not None and high is not None and low <= high
        )
        _require(ok, "bad_weight_versions", f"need both None or min <= max: {low}, {high}")
        ok = not published or (low is None) == (self.valid_row_count == 0)
        _require(ok, "bad_weight_versions", "weight versions are None exactly when no row is valid")

    def _check_failures(self, rollout_ids: set[str]) -> None:
        _require(isinstance(self.failures, tuple), "bad_failure", "failures must be a tuple")
        seen: set[str] = set()
        for item in self.failures:
            ok = isinstance(item, tuple) and len(item) == 2 and item[0] in rollout_ids - seen
            ok = ok and type(item[1]) is str and bool(item[1])
            _require(
                ok,
                "bad_failure",
                f"not a (rollout id, reason) of this group, or repeated: {item!r}",
            )
            seen.add(item[0])

    @property
    def valid_fraction(self) -> float:
        """``valid_row_count / total_row_count``; 0.0 when no row was published."""
        return self.valid_row_count / self.total_row_count if self.total_row_count else 0.0

    @property
    def valid_rollout_count(self) -> int:
        """Rollouts not listed in ``failures`` (the ones a group baseline counts)."""
        return len(self.rollout_ids) - len(self.failures)
