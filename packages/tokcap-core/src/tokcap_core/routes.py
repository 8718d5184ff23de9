"""MoE routed experts: the compact `Routes` array and the ``nrlre1`` envelope."""

from ._routes import (
    ENVELOPE_PREFIX,
    UNKNOWN_EXPERT,
    Routes,
    align_routes,
    backfill_missing_rows,
    concat_routes,
    decode_routes,
    dtype_for_experts,
    encode_routes,
    routes_from_rows,
    unknown_routes,
    unknown_rows,
    widen,
)

__all__ = [
    "ENVELOPE_PREFIX",
    "UNKNOWN_EXPERT",
    "Routes",
    "align_routes",
    "backfill_missing_rows",
    "concat_routes",
    "decode_routes",
    "dtype_for_experts",
    "encode_routes",
    "routes_from_rows",
    "unknown_routes",
    "unknown_rows",
    "widen",
]
