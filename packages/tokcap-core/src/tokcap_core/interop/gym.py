"""NeMo-Gym's token-id-capture formats: read, verify, convert and export, stdlib only.

Gym's digests (staged schema versions 2 and 3), strict readers for its staged records,
receipts, manifests and per-rollout lineage files, its verifier (``verify_and_linearize``
with its codes), and the bridge to tokcap: `verify_gym_rollout` turns a Gym rollout into
a tokcap `~tokcap_core.Receipt` and `~tokcap_core.TrainingRow` (Gym's reason kept), and
`export_gym_capture` writes a verified tokcap capture in Gym's formats.

    from tokcap_core.interop import gym

    receipt = gym.decode_gym_receipt(receipt_bytes)
    snapshots = gym.decode_gym_snapshots(snapshots_bytes)  # manifest order
    result = gym.verify_gym_rollout(receipt, snapshots)
    result.receipt.status, result.row.input_ids, result.gym_reason
"""

from ._gym_convert import (
    GYM_UNKNOWN_FINISH,
    ROUTED_EXPERTS_KEY,
    TOKCAP_FINISH_REASON_KEY,
    TOKCAP_PREFILL_ROUTE_KEY,
    TOKCAP_SPLICE_CAUSE_KEY,
    TOKCAP_WEIGHT_VERSION_LAST_KEY,
    GymVerification,
    verify_gym_rollout,
)
from ._gym_decode import (
    decode_gym_manifest,
    decode_gym_receipt,
    decode_gym_snapshots,
    decode_gym_staged_record,
    encode_gym_json,
)
from ._gym_digest import (
    EMPTY_EXTRAS_DIGEST,
    GYM_DIGEST_VERSION,
    GYM_EXTRAS_DIGEST_VERSION,
    GYM_SCHEMA_VERSIONS,
    assert_gym_golden_vectors,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    encode_token_ids,
    hash_token_ids,
)
from ._gym_errors import (
    GYM_UNCOMMITTED_CALL_REASON,
    GymConversionError,
    GymFormatError,
    GymVerificationError,
    gym_failure_reason,
)
from ._gym_export import GymCapture, export_gym_capture
from ._gym_lineage import (
    GymLineageCommit,
    GymLineageFailure,
    decode_gym_lineage,
    gym_manifest_from_lineage,
)
from ._gym_records import (
    GYM_TERMINAL_SELECTIONS,
    GymCallRecord,
    GymManifest,
    GymManifestFailure,
    GymReceipt,
    GymStagedRecord,
    gym_staging_key,
)
from ._gym_verify import GymLinearizedRow, linearize_gym_rollout, select_gym_terminal

__all__ = [
    "EMPTY_EXTRAS_DIGEST",
    "GYM_DIGEST_VERSION",
    "GYM_EXTRAS_DIGEST_VERSION",
    "GYM_SCHEMA_VERSIONS",
    "GYM_TERMINAL_SELECTIONS",
    "GYM_UNCOMMITTED_CALL_REASON",
    "GYM_UNKNOWN_FINISH",
    "ROUTED_EXPERTS_KEY",
    "TOKCAP_FINISH_REASON_KEY",
    "TOKCAP_PREFILL_ROUTE_KEY",
    "TOKCAP_SPLICE_CAUSE_KEY",
    "TOKCAP_WEIGHT_VERSION_LAST_KEY",
    "GymCallRecord",
    "GymCapture",
    "GymConversionError",
    "GymFormatError",
    "GymLineageCommit",
    "GymLineageFailure",
    "GymLinearizedRow",
    "GymManifest",
    "GymManifestFailure",
    "GymReceipt",
    "GymStagedRecord",
    "GymVerification",
    "GymVerificationError",
    "assert_gym_golden_vectors",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "decode_gym_lineage",
    "decode_gym_manifest",
    "decode_gym_receipt",
    "decode_gym_snapshots",
    "decode_gym_staged_record",
    "encode_gym_json",
    "encode_token_ids",
    "export_gym_capture",
    "gym_failure_reason",
    "gym_manifest_from_lineage",
    "gym_staging_key",
    "hash_token_ids",
    "linearize_gym_rollout",
    "select_gym_terminal",
    "verify_gym_rollout",
]
