"""tokcap adapter for TransferQueue: `TQSink`, `TQGroupBuffer`, and TransferQueue on Ray.

`TQSink` implements ``tokcap_core.TokenSink`` over TransferQueue's async KV API (a staging
partition for staged calls, a training partition for trainer-ready rows) and turns TQ's
silent partial results into errors. `TQGroupBuffer` drives the core's group-slot state
machine over it. `to_padded_batch` turns fetched rows into torch tensors; the
``encode_*``/``decode_*`` functions expose the TensorDict layout for readers of TQ itself.
Where TransferQueue runs: `local_tq` starts a loopback single-node Ray with it;
`connect_tq` runs it on an existing cluster (a CLI's ``--ray-address``); `local_cluster`
starts a loopback multi-node cluster on this machine to try that on.
Installing: ``pip install tokcap-tq`` (brings TransferQueue, Ray, torch and tensordict).
"""

import warnings

from ._buffer import SweepResult, TQGroupBuffer
from ._cluster import ClusterNode, ClusterTQ, LocalCluster, NodeSpec, connect_tq, local_cluster
from ._codec import (
    STAGING_FIELDS,
    TRAINING_FIELDS,
    decode_rows,
    decode_staged,
    encode_rows,
    encode_staged,
    to_padded_batch,
)
from ._local import LocalTQ, local_tq
from ._sink import TQSink, TQSinkConfig

__all__ = [
    "STAGING_FIELDS",
    "TRAINING_FIELDS",
    "ClusterNode",
    "ClusterTQ",
    "LocalCluster",
    "LocalTQ",
    "NodeSpec",
    "SweepResult",
    "TQGroupBuffer",
    "TQSink",
    "TQSinkConfig",
    "connect_tq",
    "decode_rows",
    "decode_staged",
    "encode_rows",
    "encode_staged",
    "local_cluster",
    "local_tq",
    "to_padded_batch",
]


def __getattr__(name: str) -> object:
    """``TQReplayBuffer`` was renamed `TQGroupBuffer`: the old name warns, then resolves."""
    if name != "TQReplayBuffer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("TQReplayBuffer is deprecated; use TQGroupBuffer", DeprecationWarning, 2)
    return TQGroupBuffer
