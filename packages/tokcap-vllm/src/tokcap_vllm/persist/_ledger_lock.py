"""The lock that keeps a ledger file to one gate (its error, `LedgerFileError`, is in `errors`).

`lock_ledger_file` holds ``<name>.lock`` beside the ledger file with an exclusive
``flock`` for as long as its descriptor stays open (a process that ends lets it go, however
it ends). Beside, not on the ledger file itself: compaction replaces the ledger file's
inode, so a lock on it would be dropped with the old file.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ..errors import LedgerFileError

__all__ = ["LedgerFileError", "lock_ledger_file"]


def lock_ledger_file(path: str | os.PathLike[str]) -> int:
    """Hold ``<path>.lock`` exclusively; returns its descriptor (closing it lets go).

    Raises `LedgerFileError` ``ledger_file_locked`` (another process holds it, pid named)
    or ``bad_ledger_path`` (the path is a directory, or its lock cannot be made).
    """
    target = Path(path)
    if target.is_dir():
        raise LedgerFileError(
            "bad_ledger_path", f"{target} is a directory; the ledger path names a file"
        )
    lock = target.with_name(target.name + ".lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise LedgerFileError("bad_ledger_path", f"cannot make {lock}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LedgerFileError("bad_ledger_path", f"cannot lock {lock}: {e.strerror}") from e
        raise LedgerFileError(
            "ledger_file_locked",
            f"{target} is held by another gate (pid {holder}); give each gate its own ledger file",
        ) from e
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd
