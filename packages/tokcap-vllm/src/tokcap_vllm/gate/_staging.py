"""What a captured call stages: its `StagedCall` row, from what the engine returned, and
what its images are known to be before the engine runs (`media_ticket`). Pure."""

from __future__ import annotations

import math
from collections.abc import Collection

from tokcap_core import StagedCall, TokcapError
from tokcap_core.provenance import kv_spans
from tokcap_core.staged import MediaItem

from ._host import EngineResult
from ._media import MediaTicket
from ._planning import PlannedRequest
from ._records import GateCall

__all__ = ["media_ticket", "staged_call"]


def media_ticket(call: GateCall, request: PlannedRequest) -> MediaTicket | None:
    """The images of admitted ``call`` (None: its request has none): every image's byte
    digest, and the items its parent chain recorded, which lie in its admitted prefix."""
    if not request.images:
        return None
    assert call.plan is not None
    history: list[MediaItem] = []
    parent = call.parent
    while parent is not None:
        if parent.staged is not None and parent.staged.media:
            history[:0] = parent.staged.media
        parent = parent.parent
    return MediaTicket(
        digests=request.images, history=tuple(history), prefix_len=call.plan.prefix_len
    )


def staged_call(
    call: GateCall,
    result: EngineResult,
    capture_routes: bool,
    *,
    kv_kept: Collection[int] = (),
) -> StagedCall:
    """The row the sink stores for an admitted call the engine finished.

    Its weight spans are the engine's; its KV spans follow from the version its prompt was
    salted with and ``kv_kept``, the versions whose push let calls in flight keep their KV.

    Refused (`TokcapError`): ``engine_incomplete`` (no output, or a finish reason other
    than ``stop``/``length``), ``bad_logprobs`` (a NaN), ``routes_missing`` (routes are
    to be captured but the engine returned none).
    """
    if result.finish_reason not in ("stop", "length") or not result.output_ids:
        raise TokcapError("engine_incomplete", f"finish_reason={result.finish_reason!r}")
    if any(map(math.isnan, result.logprobs)):
        raise TokcapError("bad_logprobs", "NaN logprob")
    if result.routes is None and capture_routes:
        raise TokcapError(
            "routes_missing",
            "CaptureConfig.capture_routes is set but the engine returned no routed experts "
            "(start vLLM with routed-experts capture enabled)",
        )
    assert call.plan is not None
    assert call.call_id is not None
    parent = call.parent
    return StagedCall.from_engine_output(
        rollout_id=call.rollout.rollout_id,
        call_id=call.call_id,
        parent_id=call.plan.parent_id,
        parent_cum_len=call.plan.prefix_len,
        parent_chain_hash=parent.staged.chain_hash
        if parent is not None and parent.staged is not None
        else None,
        prompt_ids=result.prompt_ids,
        output_ids=result.output_ids,
        logprobs=result.logprobs,
        finish_reason=result.finish_reason or "",
        weight_version=result.weight_version,
        weight_version_last=result.weight_version_last,
        weight_versions=result.weight_versions,
        kv_versions=kv_spans(
            result.weight_versions,
            salt_version=min(result.salt_version, result.weight_version),
            recomputed=lambda version: version not in kv_kept,
        ),
        routes=result.routes,
        media=result.media,
    )
