"""The custody ledger: events, the pure state machine (`apply`, `replay`), manifests and digests."""

from . import _events, _ledger, _manifest
from ._digest import ZERO_HASH, chain_hash, genesis_hash
from ._events import *  # noqa: F403
from ._ledger import *  # noqa: F403
from ._manifest import *  # noqa: F403

__all__ = [
    *_events.__all__,
    *_ledger.__all__,
    *_manifest.__all__,
    "ZERO_HASH",
    "chain_hash",
    "genesis_hash",
]
