"""Test helpers: a staged call's weight versions changed consistently (spans included)."""

from __future__ import annotations

import dataclasses

from tokcap_core import StagedCall
from tokcap_core.provenance import VersionSpan


def shifted(call: StagedCall, by: int) -> StagedCall:
    """``call`` with every weight version (first, last, each span) moved up by ``by``; the
    digest is left as claimed (it no longer matches)."""

    def move(spans: tuple[VersionSpan, ...] | None) -> tuple[VersionSpan, ...] | None:
        if spans is None:
            return None
        return tuple(dataclasses.replace(s, version=s.version + by) for s in spans)

    return dataclasses.replace(
        call,
        weight_version=call.weight_version + by,
        weight_version_last=call.weight_version_last + by,
        weight_versions=move(call.weight_versions),
        kv_versions=move(call.kv_versions),
    )
