"""tokcap-core: custody of the exact tokens an inference engine saw and produced.

Stdlib only and sans-I/O: ids and digests, staged calls, the hash-chained custody
ledger, manifests, receipts, verification, reassembly into training rows, mask-aware
advantages, group slots and the RPC contract. Adapters (``tokcap_tq``,
``tokcap_vllm``, ``tokcap_ray``) feed it events and act on what it returns.

The top level holds what a trainer author needs; the rest lives in named public
submodules: `tokcap_core.ids` (id types and keys), `.ledger` (events, the state
machine, manifests, digests), `.staged`, `.receipts`, `.rows`, `.reasons`, `.routes`,
`.rpc` (reassembly contract and group policy), `.slots` (group slots), `.sink`,
`.advantages`, `.parity`, `.metrics`, `.provenance` (per-token weight and KV versions,
staleness), `.golden`, `.simulate`, `.errors`, `.states`
(the named states every state machine here and in the adapters uses), `.testing`
(hypothesis strategies) and `.interop` (peers' capture formats).
"""

from ._errors import (
    ConfigError,
    InvalidId,
    LedgerProtocolError,
    MissingRows,
    ReassemblyError,
    SinkError,
    TokcapError,
    VerificationError,
)
from ._ledger import Entry, Ledger
from ._manifest import Manifest, decode_manifest, verify_manifest
from ._policy import Accept, Drop, Replace, decide_group
from ._reassembly import reassemble, verify_staged
from ._receipt import Receipt, assemble_receipt
from ._rows import TrainingRow, placeholder_row
from ._rpc import FinalizedGroup, ReassemblyRequest
from ._staged import StagedCall
from .advantages import dr_grpo, grpo, masked_mean, reinforce_pp, rloo
from .config import CaptureConfig
from .parity import (
    LogprobParity,
    logprob_parity,
    sequence_ratio_mask,
    truncated_importance_weights,
)
from .sink import MemorySink, TokenSink

__all__ = [
    "Accept",
    "CaptureConfig",
    "ConfigError",
    "Drop",
    "Entry",
    "FinalizedGroup",
    "InvalidId",
    "Ledger",
    "LedgerProtocolError",
    "LogprobParity",
    "Manifest",
    "MemorySink",
    "MissingRows",
    "ReassemblyError",
    "ReassemblyRequest",
    "Receipt",
    "Replace",
    "SinkError",
    "StagedCall",
    "TokcapError",
    "TokenSink",
    "TrainingRow",
    "VerificationError",
    "assemble_receipt",
    "decide_group",
    "decode_manifest",
    "dr_grpo",
    "grpo",
    "logprob_parity",
    "masked_mean",
    "placeholder_row",
    "reassemble",
    "reinforce_pp",
    "rloo",
    "sequence_ratio_mask",
    "truncated_importance_weights",
    "verify_manifest",
    "verify_staged",
]
