"""The gate's ledger file (`LedgerFile`), its lock and its error."""

from ._ledger_file import LedgerFile, LedgerFileError, lock_ledger_file, read_ledger_records

__all__ = ["LedgerFile", "LedgerFileError", "lock_ledger_file", "read_ledger_records"]
