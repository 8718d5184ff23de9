"""Command-line and environment options derived from config classes' fields.

Every field of a config class (attrs or dataclass) becomes an `Option`: the flag
``--tokcap-<field-with-dashes>`` and the environment variable ``TOKCAP_<FIELD>``, parsed
by the field's type (``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``tuple[str,
...]`` as comma-separated text, and any of them ``| None``, written ``none``). Nothing is
hand-listed: a field added to `GateConfig`, `CaptureConfig` or a sink's config class is an
option at once. A value that does not parse, or that the class refuses, is a `ConfigError`
``bad_<field>`` whose message starts with the flag.

Bool options are switches: ``--tokcap-require-open`` sets True, ``--tokcap-x=false``
False; other options take ``--tokcap-x VALUE`` or ``--tokcap-x=VALUE``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from tokcap_core import ConfigError

__all__ = ["FLAG_PREFIX", "Option", "build", "options_of", "split_argv"]

FLAG_PREFIX = "--tokcap-"
ENV_PREFIX = "TOKCAP_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@attrs.frozen
class Option:
    """One config field as a flag and an environment variable."""

    owner: type[Any]
    field: str
    type: Any
    default: Any
    """`attrs.NOTHING` when the field is required."""

    @property
    def flag(self) -> str:
        """``--tokcap-<field-with-dashes>``."""
        return FLAG_PREFIX + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        """``TOKCAP_<FIELD>``."""
        return ENV_PREFIX + self.field.upper()

    @property
    def required(self) -> bool:
        """Whether the field has no default."""
        return self.default is attrs.NOTHING

    @property
    def switch(self) -> bool:
        """Whether the flag takes no separate value (a bool field)."""
        return bool in _members(self.type)

    def parse(self, text: str) -> Any:
        """The field's value for ``text``; `ConfigError` ``bad_<field>`` if it does not parse."""
        try:
            return _parse(self.type, text.strip())
        except ValueError as e:
            raise self.bad(f"{e}: {text!r}") from None

    def bad(self, message: str) -> ConfigError:
        """The error naming this option."""
        return ConfigError(f"bad_{self.field}", f"{self.flag} ({self.env}): {message}")

    def describe(self) -> str:
        """One help line: flag, value kind, default, environment variable."""
        kind = "" if self.switch else f" {_kind(self.type)}"
        default = "required" if self.required else f"default: {_show(self.default)}"
        return f"  {self.flag}{kind}  ({default}; env {self.env})"


def options_of(cls: type[Any], *, exclude: Iterable[str] = ()) -> list[Option]:
    """Every field of ``cls`` (attrs or dataclass) but ``exclude``, as options."""
    hints = typing.get_type_hints(cls)
    left_out = frozenset(exclude)
    fields: list[tuple[str, Any]]
    if attrs.has(cls):
        fields = [(a.name, _attrs_default(a.default)) for a in attrs.fields(cls)]
    else:
        fields = [
            (f.name, f.default if f.default is not dataclasses.MISSING else attrs.NOTHING)
            for f in dataclasses.fields(cls)
        ]
    return [
        Option(cls, name, hints[name], default) for name, default in fields if name not in left_out
    ]


def _attrs_default(default: Any) -> Any:
    factory = getattr(default, "factory", None)
    return factory() if factory is not None and type(default).__name__ == "Factory" else default


def split_argv(argv: Sequence[str], options: Sequence[Option]) -> tuple[dict[str, str], list[str]]:
    """``({field: text}, other arguments)``: the ``--tokcap-*`` options taken out of ``argv``.

    `ConfigError` ``bad_option`` names an unknown ``--tokcap-*`` flag, a repeated one, or
    one missing its value.
    """
    by_flag = {o.flag: o for o in options}
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith(FLAG_PREFIX):
            rest.append(arg)
            continue
        flag, has_value, text = arg.partition("=")
        option = by_flag.get(flag)
        if option is None:
            raise ConfigError(
                "bad_option", f"{flag}: no such option (see tokcap-vllm serve --help)"
            )
        if option.field in values:
            raise option.bad("given more than once")
        if not has_value:
            if option.switch:
                text = "true"
            elif i < len(argv):
                text, i = argv[i], i + 1
            else:
                raise option.bad("needs a value")
        values[option.field] = text
    return values, rest


def from_environ(environ: Mapping[str, str], options: Sequence[Option]) -> dict[str, str]:
    """``{field: text}`` for every option whose ``TOKCAP_<FIELD>`` variable is set."""
    return {o.field: environ[o.env] for o in options if o.env in environ}


def build(cls: type[Any], options: Sequence[Option], texts: Mapping[str, str], **extra: Any) -> Any:
    """``cls(**parsed texts, **extra)``; every refusal is a `ConfigError` naming an option.

    A value the class refuses is tried alone (over the defaults) to find the option at
    fault; a refusal of a combination keeps the class's own code.
    """
    mine = [o for o in options if o.owner is cls]
    parsed = {o.field: o.parse(texts[o.field]) for o in mine if o.field in texts}
    for option in mine:
        if option.required and option.field not in parsed:
            raise option.bad(f"is required (or set {option.env})")
    try:
        return cls(**parsed, **extra)
    except ConfigError as whole:
        required = {o.field: parsed[o.field] for o in mine if o.required}
        for option in mine:
            if option.field not in parsed:
                continue
            try:
                cls(**{**required, option.field: parsed[option.field]})
            except ConfigError as alone:
                raise option.bad(alone.message) from None
        at_fault = [o for o in mine if whole.code == f"bad_{o.field}"]
        if at_fault:
            raise at_fault[0].bad(whole.message) from None
        raise ConfigError(whole.code, whole.message) from None


def help_lines(options: Sequence[Option]) -> list[str]:
    """One line per option (see `Option.describe`)."""
    return [o.describe() for o in options]


# ---- types -----------------------------------------------------------------------------


def _members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _parse(tp: Any, text: str) -> Any:
    members = _members(tp)
    if type(None) in members:
        if text.lower() in ("", "none"):
            return None
        (tp,) = [m for m in members if m is not type(None)]
    parser = _PARSERS.get(tp)
    if parser is not None:
        return parser(text)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}")
        return text
    if origin is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    raise ValueError(f"cannot be set from text ({tp!r})")


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("must be true or false")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("must be an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


_PARSERS: dict[Any, Callable[[str], Any]] = {bool: _bool, int: _int, float: _float, str: str}


def _kind(tp: Any) -> str:
    members = [m for m in _members(tp) if m is not type(None)]
    (tp,) = members
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(map(str, typing.get_args(tp))) + "}"
    if typing.get_origin(tp) is tuple:
        return "A,B,..."
    return {bool: "BOOL", int: "INT", float: "NUMBER", str: "TEXT"}.get(tp, "VALUE")


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "(empty)"
    return str(value)
