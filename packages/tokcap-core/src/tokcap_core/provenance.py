"""Per-token provenance (capture format v3): weight-version spans, KV spans, staleness.

`VersionSpan` and the spans a staged call, its ledger event, its receipt call and its row
carry; `kv_spans` derives the KV spans a push mode leaves; `row_staleness`,
`receipt_staleness` and `check_staleness` measure and bound how far behind the trained
weights tokens were sampled (from receipts alone, as ``tokcap-core verify
--max-staleness K --trained-version V`` does).
"""

from . import _provenance
from ._provenance import *  # noqa: F403

__all__ = [*_provenance.__all__]
