"""The gate's append-only ledger file."""

from ._persist import LedgerFile, LedgerFileError, read_ledger_records

__all__ = ["LedgerFile", "LedgerFileError", "read_ledger_records"]
