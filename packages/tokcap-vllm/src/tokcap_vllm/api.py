"""The control plane's wire bodies (msgspec structs), its weight routes' included: the
server's (`ControlPlane`, the guarded weight routes), the clients', and for clients in any
language.

Request bodies refuse unknown fields, so a typo is a 422, not a silently ignored witness.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from tokcap_core.reasons import MANIFEST_INVALID

__all__ = [
    "CONTROL_PREFIX",
    "MANIFEST_FAILURE_BUCKET",
    "MAX_CLOSE_BATCH",
    "WEIGHTS_PATH",
    "CloseBody",
    "CloseManyBody",
    "CloseManyItem",
    "CloseManyResponse",
    "CloseOutcome",
    "CloseProblem",
    "ErrorBody",
    "Head",
    "HeadResponse",
    "Health",
    "HoldBody",
    "OpenResponse",
    "ReleaseResponse",
    "RolloutItem",
    "RolloutPage",
    "RouteItem",
    "RouteTable",
    "TerminalBody",
    "UploadResponse",
    "WeightInfo",
    "WeightSpec",
    "WitnessBody",
    "error_json",
]

CONTROL_PREFIX: Final = "/tokcap/v1/"
MANIFEST_FAILURE_BUCKET: Final = MANIFEST_INVALID
"""The failure bucket of a receipt whose manifest was missing or did not verify."""

RolloutStateName = Literal["open", "closed"]


class TerminalBody(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST …/terminal``: exactly one of ``call_id`` or ``response_id``."""

    call_id: str | None = None
    response_id: str | None = None


class WitnessBody(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What the scorer saw: the scored response id and/or the scored output.

    ``content`` (with ``tool_calls`` if any) is fingerprinted by the gate exactly as it
    fingerprints returned messages; ``content_fingerprint`` gives that fingerprint directly.
    """

    response_id: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    content_fingerprint: str | None = None


class CloseBody(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST …/close``: the reward (None: unscored) and the witnesses."""

    reward: float | None = None
    witnesses: WitnessBody | None = None


class Head(msgspec.Struct):
    """A ledger head: the last entry's ``seq`` and ``hash``."""

    seq: int
    hash: str


class HeadResponse(msgspec.Struct):
    """The answer to close and terminal: the rollout and its ledger head after the call."""

    rollout_id: str
    head: Head


MAX_CLOSE_BATCH: Final = 4096
"""The most rollouts one ``POST /tokcap/v1/close`` may close."""


class CloseManyItem(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One rollout of ``POST /tokcap/v1/close``: its id, reward and witnesses, and the
    terminal call its harness declared, if it did (``terminal``: named in the same request,
    as ``POST …/terminal`` would name it, just before the close)."""

    rollout_id: str
    reward: float | None = None
    witnesses: WitnessBody | None = None
    terminal: TerminalBody | None = None


class CloseManyBody(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /tokcap/v1/close``: close every rollout listed with one durable write
    (distinct ids, at most `MAX_CLOSE_BATCH`)."""

    rollouts: list[CloseManyItem]
    manifests: bool = False
    """Answer each closed rollout's manifest too (`CloseOutcome.manifest`), so the trainer
    verifies its receipt without another request."""


class CloseProblem(msgspec.Struct):
    """Why one rollout of a batch did not close durably: the status and stable code the
    single-rollout close would have answered."""

    status: int
    code: str
    message: str


class CloseOutcome(msgspec.Struct, omit_defaults=True):
    """One rollout's answer in a batch close: its durable head, or its problem."""

    rollout_id: str
    head: Head | None = None
    error: CloseProblem | None = None
    manifest: msgspec.Raw = msgspec.Raw()
    """With ``manifests`` asked: the closed rollout's manifest, exactly the bytes ``GET
    …/manifest`` answers (empty when not asked, or over the gate's manifest bound: fetch
    it then)."""


class CloseManyResponse(msgspec.Struct):
    """The answer to ``POST /tokcap/v1/close``: one outcome per rollout, in request order."""

    results: list[CloseOutcome]


class OpenResponse(msgspec.Struct):
    """The answer to ``POST …/open``."""

    rollout_id: str
    opened: bool
    owner: str | None = None
    """Who holds the rollout (the ``X-Tokcap-Owner`` it was opened with; None: anyone)."""
    instance: str = ""
    """This gate process's instance id (a restarted gate has a new one)."""


class ReleaseResponse(msgspec.Struct):
    """The answer to ``DELETE …``."""

    rollout_id: str
    released: bool


class RolloutItem(msgspec.Struct):
    """One rollout of a listing."""

    rollout_id: str
    state: RolloutStateName
    owner: str | None = None
    """Who holds it (None: opened without an owner, anyone may close it)."""


class RolloutPage(msgspec.Struct):
    """``GET /tokcap/v1/rollouts``: ids in ascending order; pass ``next_cursor`` as ``after``."""

    rollouts: list[RolloutItem]
    next_cursor: str | None


class Health(msgspec.Struct):
    """``GET /tokcap/v1/health``."""

    status: Literal["ok", "degraded", "down"]
    serving: bool
    rollouts_open: int
    rollouts_closed: int
    ledger_file: bool
    ledger_error: str | None
    sink: str = ""
    """``memory`` (no trainer can read it), or the sink's class name."""
    warnings: list[str] = []
    """Problems that do not stop serving (``memory_sink: ...``)."""
    instance: str = ""
    """This gate process's instance id: a new one after a restart (what a fleet compares)."""
    sink_error: str | None = None
    """Why the sink cannot take staged calls now (its TransferQueue is gone, ...): captured
    calls are refused (``sink_unavailable``) until it can."""
    weights: str = "READY"
    """The engine's weights as the gate admits calls: READY, PUSHING, or FAILED with why."""
    engine: str = "unknown"
    """The engine's own state: ``running``, ``paused`` (calls wait), ``asleep``,
    ``unresponsive`` (no answer within the health's bound) or ``unknown`` (no engine)."""


class RouteItem(msgspec.Struct):
    """One route the server mounts and how the gate answers it (`control._route_table`)."""

    path: str
    methods: list[str]
    access: Literal["public", "guarded", "refused"]
    reason: str
    listed: bool
    """False: the table does not name it (guarded by default)."""


class RouteTable(msgspec.Struct):
    """``GET /tokcap/v1/routes``: every route of the server's app, classified."""

    routes: list[RouteItem]


WEIGHTS_PATH: Final = CONTROL_PREFIX + "weights"
"""tokcap's weight routes (`tokcap_vllm.weights.GateWeightClient` drives them)."""


class WeightInfo(msgspec.Struct):
    """``GET /tokcap/v1/weights``: the gate's weight state and the engine's label."""

    phase: str
    """READY, PUSHING or FAILED as the gate admits calls (FAILED while held)."""
    version: int
    """The last version loaded in full."""
    engine_phase: str
    """The engine's own phase, the hold aside."""
    held: str | None
    error: str | None
    engine_version: str
    """The label vLLM attaches to outputs (``/weight_info``)."""


class WeightSpec(msgspec.Struct):
    """``GET /tokcap/v1/weights/spec``: ``{name: [dtype, shape]}`` and the tied pairs."""

    tensors: dict[str, tuple[str, list[int]]]
    tied: list[tuple[str, str]]


class HoldBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /tokcap/v1/weights/hold``."""

    reason: str


class UploadResponse(msgspec.Struct):
    """``PUT /tokcap/v1/weights/upload``: where the bytes now are, on the gate's host."""

    path: str
    nbytes: int


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str


class ErrorBody(msgspec.Struct):
    """Every error answer (the OpenAI error shape, with a stable ``code``)."""

    error: _ErrorDetail
    object: str = "error"


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "ContentTooLargeError",
    422: "UnprocessableEntityError",
    503: "ServiceUnavailableError",
}


def error_json(code: str, message: str, status: int) -> bytes:
    """The one error body the gate answers with: OpenAI's error shape with a stable ``code``.

    The message starts with ``[code]`` because the ``openai`` client shows only the message
    in its exceptions; `ControlPlaneClient` strips it again.
    """
    kind = _TYPES.get(status, "InternalServerError")
    detail = _ErrorDetail(message=f"[{code}] {message}", type=kind, code=code)
    return msgspec.json.encode(ErrorBody(error=detail))
