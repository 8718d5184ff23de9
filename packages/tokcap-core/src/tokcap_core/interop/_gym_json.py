"""Strict JSON for Gym's wire models: one accepted spelling per value, typed refusals.

Gym's models are pydantic with ``extra="forbid"`` and strict types; this reader refuses
the same things (unknown keys, wrong JSON types, NaN/Infinity) and a little more:
duplicate object keys (JSON parsers silently keep the last one) and, where Gym's model
is lax (``reward: float``, ``capture_poisoned: bool``), strings standing in for numbers
or booleans. A float column accepts JSON integers as Gym's strict floats do (``1`` reads
as ``1.0``); ``-0.0`` stays ``-0.0``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, TypeVar

from ._gym_digest import is_hex_digest
from ._gym_errors import GymFormatError

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "FieldReader",
    "load_json",
    "load_json_lines",
    "read_fields",
]

MAX_DOCUMENT_BYTES: Final = 256 * 1024 * 1024
_MISSING: Final = object()
_T = TypeVar("_T")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise GymFormatError("duplicate_key", "a JSON object repeats a key")
    return obj


def _constant(name: str) -> float:
    raise GymFormatError("non_finite", f"{name} is not allowed")


def load_json(data: bytes | str, *, max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """Parse one JSON document strictly (``too_large``, ``bad_json``, ``duplicate_key``...)."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise GymFormatError("too_large", f"{len(raw)} bytes exceeds {max_bytes}")
    try:
        return json.loads(raw, object_pairs_hook=_pairs, parse_constant=_constant)
    except GymFormatError:
        raise
    except (ValueError, RecursionError) as e:
        raise GymFormatError("bad_json", f"not JSON: {e}") from None


def load_json_lines(data: bytes | str, *, max_bytes: int = MAX_DOCUMENT_BYTES) -> list[Any]:
    """Parse JSON Lines strictly: one value per non-blank line."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise GymFormatError("too_large", f"{len(raw)} bytes exceeds {max_bytes}")
    return [load_json(line) for line in raw.splitlines() if line.strip()]


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


class FieldReader:
    """Reads the fields of one JSON object; `finish` refuses any key nobody read."""

    def __init__(self, obj: object, what: str) -> None:
        if not isinstance(obj, dict):
            raise GymFormatError("wrong_type", f"{what} must be a JSON object")
        self._obj: dict[str, Any] = obj
        self._what = what
        self._read: set[str] = set()

    def _bad(self, code: str, key: str, message: str) -> GymFormatError:
        return GymFormatError(code, f"{self._what}.{key}: {message}")

    def has(self, key: str) -> bool:
        """Whether ``key`` is present (it then counts as read)."""
        self._read.add(key)
        return key in self._obj

    def _get(self, key: str, default: object) -> Any:
        self._read.add(key)
        if key in self._obj:
            return self._obj[key]
        if default is _MISSING:
            raise self._bad("missing_field", key, "is required")
        return default

    def _typed(
        self, key: str, default: object, check: Callable[[Any], bool], want: str, *, null: bool
    ) -> Any:
        if key not in self._obj and default is not _MISSING:
            self._read.add(key)
            return default
        value = self._get(key, _MISSING)
        if value is None and null:
            return None
        if not check(value):
            raise self._bad("wrong_type", key, f"must be {want}, got {_type_name(value)}")
        return value

    def text(self, key: str, *, null: bool = False, default: object = _MISSING) -> Any:
        """A string (``Identifier`` fields use `identifier`)."""
        return self._typed(key, default, lambda v: type(v) is str, "a string", null=null)

    def identifier(self, key: str, *, null: bool = False, default: object = _MISSING) -> Any:
        """A non-empty string."""
        value = self.text(key, null=null, default=default)
        if value == "":
            raise self._bad("empty_identifier", key, "must not be empty")
        return value

    def uint(self, key: str, *, default: object = _MISSING) -> Any:
        """A non-negative JSON integer below 2**64."""
        value = self._typed(key, default, _is_int, "an integer", null=False)
        if not 0 <= value < 2**64:
            raise self._bad("out_of_range", key, f"must lie in [0, 2**64), got {value}")
        return value

    def version(self, key: str) -> int:
        """A version number (required: a reader of two schemas cannot guess one)."""
        value: int = self._typed(key, _MISSING, _is_int, "an integer", null=False)
        return value

    def boolean(self, key: str, *, default: object = _MISSING) -> Any:
        """A JSON boolean."""
        return self._typed(key, default, lambda v: type(v) is bool, "a boolean", null=False)

    def number(self, key: str, *, null: bool = False, default: object = _MISSING) -> Any:
        """A finite number, as a float (JSON integers read as floats)."""
        value = self._typed(key, default, _is_number, "a number", null=null)
        return value if value is None else _as_float(value)

    def hexdigest(self, key: str, *, null: bool = False, default: object = _MISSING) -> Any:
        """64 lowercase hex characters."""
        value = self.text(key, null=null, default=default)
        if value is not None and not is_hex_digest(value):
            raise self._bad("bad_hex", key, "must be 64 lowercase hex characters")
        return value

    def choice(self, key: str, choices: Sequence[str], *, null: bool = False, **kw: Any) -> Any:
        """One of ``choices``."""
        value = self.text(key, null=null, **kw)
        if value is not None and value not in choices:
            raise self._bad("bad_value", key, f"must be one of {list(choices)}, got {value!r}")
        return value

    def items(self, key: str, read: Callable[[Any], _T], *, default: object = _MISSING) -> Any:
        """A JSON array, each item through ``read``."""
        value = self._typed(key, default, lambda v: type(v) is list, "an array", null=False)
        return tuple(read(item) for item in value)

    def int_column(self, key: str) -> tuple[int, ...]:
        """An array of non-negative integers (token ids) below 2**64."""
        values = self.items(key, lambda v: v)
        if not all(_is_int(v) for v in values):
            raise self._bad("wrong_type", key, "must hold integers")
        if any(not 0 <= v < 2**64 for v in values):
            raise self._bad("out_of_range", key, "ids must lie in [0, 2**64)")
        return tuple(values)

    def float_column(self, key: str) -> tuple[float, ...]:
        """An array of finite numbers, as floats."""
        values = self.items(key, lambda v: v)
        if not all(_is_number(v) for v in values):
            raise self._bad("wrong_type", key, "must hold numbers")
        return tuple(_as_float(v) for v in values)

    def raw(self, key: str, *, default: object = _MISSING) -> Any:
        """The value as parsed (the caller checks it)."""
        return self._get(key, default)

    def finish(self) -> None:
        """Refuse keys that no reader asked for (Gym's ``extra="forbid"``)."""
        unknown = sorted(set(self._obj) - self._read)
        if unknown:
            raise GymFormatError("unknown_field", f"{self._what}: unknown keys {unknown[:8]}")


@contextmanager
def read_fields(obj: object, what: str) -> Iterator[FieldReader]:
    """A `FieldReader` of ``obj`` whose `FieldReader.finish` runs when the block ends
    without an error (a block that raised has its own error to report)."""
    fields = FieldReader(obj, what)
    yield fields
    fields.finish()


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return (type(value) is int or type(value) is float) and _finite(value)


def _finite(value: object) -> bool:
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:
        return False


def _as_float(value: int | float) -> float:
    return value if type(value) is float else float(value)
