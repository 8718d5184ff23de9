"""The gate's ledger file: one append-only record per ledger entry, replayed at start.

- `LedgerFile` (``_ledger_file``): the file, its records, its recovery and compaction (the
  format is described there); `read_ledger_records` reads one;
- `lock_ledger_file` (``_ledger_lock``): one gate per file;
- `GateHooks` (``_hooks``): what the gate tells its observers, the ledger file and the
  metrics among them; `make_durable`: a close told to all of them.
"""

from ..errors import LedgerFileError
from ._hooks import GateHooks, make_durable
from ._ledger_file import LedgerFile, read_ledger_records
from ._ledger_lock import lock_ledger_file

__all__ = [
    "GateHooks",
    "LedgerFile",
    "LedgerFileError",
    "lock_ledger_file",
    "make_durable",
    "read_ledger_records",
]
