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

from . import (
    _gym_convert,
    _gym_decode,
    _gym_digest,
    _gym_errors,
    _gym_export,
    _gym_lineage,
    _gym_records,
    _gym_verify,
)
from ._gym_convert import *  # noqa: F403
from ._gym_decode import *  # noqa: F403
from ._gym_digest import *  # noqa: F403
from ._gym_errors import *  # noqa: F403
from ._gym_export import *  # noqa: F403
from ._gym_lineage import *  # noqa: F403
from ._gym_records import *  # noqa: F403
from ._gym_verify import *  # noqa: F403

__all__ = [
    *_gym_convert.__all__,
    *_gym_decode.__all__,
    *_gym_digest.__all__,
    *_gym_errors.__all__,
    *_gym_export.__all__,
    *_gym_lineage.__all__,
    *_gym_records.__all__,
    *_gym_verify.__all__,
]
