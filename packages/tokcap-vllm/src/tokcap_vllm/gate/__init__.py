"""The gate: one captured call inside vLLM's server, from its request to its commit.

- the driver: `Gate` (``_gate``: holds the rollouts, serves the control operations, runs
  the capture path) and `CapturePath` (``_capture``: one call, waits, writes and tells);
- the one owner of a rollout's events, pure: `RolloutBook` (``_rollouts``: the rollout's
  events and who holds it), its call events (``_lifecycle``), the records and the tables
  of their phases (``_records``); the staged row and ledger entry of a finished call
  (``_staging``) and their batched writes into the sink (``_stage_writer``);
- planning the next prompt on the parent's exact ids (``_planning``, a room of its own);
- the four APIs a rollout may speak: chat and completions (``_wire``, with the response
  fields the gate watches), Responses (``_responses``) and Messages (``_messages``),
  decoded by ``_apis``; what an answer returned, read back as a turn (``_answers``);
- remote images an operator allowed, fetched once and bound as data URLs
  (``_remote_media``);
- the engine: the capture host around vLLM's async engine (``_host``, ``_logprob_text``),
  the one way vLLM is imported (``_vllm``);
- which rollout a request belongs to (``_routing``), the metrics (``_metrics``), the
  configuration (`GateConfig`, ``_config``; options from its fields, ``_options``; a
  served gate from options or ``TOKCAP_*``, ``_served``).

The ASGI door that puts the gate into vLLM's server, and ``tokcap-vllm serve``, are in
`tokcap_vllm.server`; the trainer's control plane is `tokcap_vllm.control`. Besides the
gate itself this door names what those two rooms use of it.
"""

from ._answers import ResponsesAnswer
from ._apis import decode_request, planned_on, stream_error_event
from ._capture import AnswerAgain, CapturePath, Serve
from ._config import CONTROL_TOKEN_ENV, LEDGER_PATH_ENV, GateConfig
from ._gate import Gate, GateHealth
from ._host import CURRENT_TICKET, CaptureHost, EngineResult, Ticket
from ._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ._metrics import GateMetrics
from ._options import FLAG_PREFIX, from_environ, split_argv
from ._planning import Observed, RequestRenderer, request_renderer
from ._records import ABANDONED, Flag, GateCall
from ._remote_media import fetch_remote_media
from ._routing import parse_rollout_id, route_request
from ._served import describe_sink, gate_help, served_gate, served_options
from ._vllm import INSTALL_HINT, require_vllm
from ._wire import ResponseObserver, decode_json

__all__ = [
    "ABANDONED",
    "CONTROL_TOKEN_ENV",
    "CURRENT_TICKET",
    "FLAG_PREFIX",
    "INSTALL_HINT",
    "LEDGER_PATH_ENV",
    "METRICS_CONTENT_TYPE",
    "AnswerAgain",
    "CaptureHost",
    "CapturePath",
    "EngineResult",
    "Flag",
    "Gate",
    "GateCall",
    "GateConfig",
    "GateHealth",
    "GateMetrics",
    "Observed",
    "RequestRenderer",
    "ResponseObserver",
    "ResponsesAnswer",
    "Serve",
    "Ticket",
    "decode_json",
    "decode_request",
    "describe_sink",
    "fetch_remote_media",
    "from_environ",
    "gate_help",
    "parse_rollout_id",
    "planned_on",
    "request_renderer",
    "require_vllm",
    "route_request",
    "served_gate",
    "served_options",
    "split_argv",
    "stream_error_event",
]
