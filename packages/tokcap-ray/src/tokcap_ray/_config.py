"""`PoolConfig`: how many reassembler actors, where they run and how much may be in flight."""

from __future__ import annotations

from typing import Any

import attrs

from tokcap_core import ConfigError
from tokcap_core.config import at_least, positive_number

__all__ = ["PoolConfig"]


def _present(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        raise ConfigError(f"bad_{attribute.name}", f"{attribute.name} must not be None")


@attrs.frozen(kw_only=True)
class PoolConfig:
    """Settings of a `ReassemblerPool`; an invalid value raises `ConfigError` ``bad_<field>``.

    ``scheduling_strategy`` goes to Ray as is: ``"SPREAD"`` (default: actors over as
    many nodes as possible), ``"DEFAULT"``, or a Ray strategy object (placement group,
    node affinity). ``max_in_flight`` bounds requests submitted and not finished over
    the whole pool; ``actor_concurrency`` bounds the requests one actor works on at
    once (their sink I/O overlaps, their CPU work does not). ``max_retries``: how many
    times a request is retried on a replacement actor after its actor died.
    """

    num_workers: int = attrs.field(validator=at_least(1))
    num_cpus: float = attrs.field(default=1.0, validator=positive_number)
    max_in_flight: int = attrs.field(default=64, validator=at_least(1))
    actor_concurrency: int = attrs.field(default=8, validator=at_least(1))
    max_retries: int = attrs.field(default=2, validator=at_least(0))
    scheduling_strategy: Any = attrs.field(default="SPREAD", validator=_present)
