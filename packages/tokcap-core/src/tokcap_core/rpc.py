"""The reassembly RPC contract (metadata only) and the controller's group policy."""

from . import _policy, _rpc
from ._policy import *  # noqa: F403
from ._rpc import *  # noqa: F403

__all__ = [*_policy.__all__, *_rpc.__all__]
