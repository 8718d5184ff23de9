"""The gate's ledger file: one append-only record per ledger entry, replayed at start.

Format (JSON lines, ASCII): each entry is one line holding a *one-entry manifest*
(``encode_manifest`` of that entry, ``tokcap/manifest/v1``), so every record decodes
strictly with the core and carries its rollout id; forgetting a released rollout is a
``{"release":"<rollout_id>"}`` line. Each record is one ``write`` on an ``O_APPEND`` file
descriptor (it survives the process being killed); the file is fsync'ed when a rollout
closes, before the close returns its head.

Reading: a last record that is incomplete or undecodable is a torn write: it is cut off,
the damaged original is kept next to the file (``<name>.damaged-<ns>``), a warning says
what was cut, and health reports the recovery. Any earlier bad record, or entries whose
hash chain does not replay, stop the start (`LedgerFileError`) rather than serve a
history nobody can vouch for. Compaction rewrites the file without released rollouts
(temp file, fsync, rename, fsync of the folder): always at start, and at run time once
enough rollouts were released.

One gate per file: `LedgerFile.open` takes an exclusive lock (``flock``) on
``<name>.lock`` beside the file and holds it while the file is open (the process's end
lets it go); a second gate given the same path refuses to start (``ledger_file_locked``,
naming the holder's pid) instead of interleaving two gates' records and each replacing the
other's file at compaction. The lock file is beside, not the ledger file itself, because
compaction replaces the ledger file's inode.

Write failures are contained to their rollout: a record that cannot be written (disk
full, I/O error) is cut back off the file (``ftruncate`` to the size before it) and no
later record of that rollout is written, so the file always holds a valid prefix of every
ledger (on restart such a rollout is open, hence poisoned). The failing append raises
`LedgerFileError` (``ledger_write_failed``) for the gate to poison that rollout alone. Only
if the cut itself fails is the file *broken*: every later append then fails.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio

from tokcap_core import (
    Entry,
    Ledger,
    Manifest,
    StagedCall,
    TokcapError,
    VerificationError,
    decode_manifest,
)
from tokcap_core.ids import validate_rollout_id
from tokcap_core.ledger import encode_manifest

from ._hooks import GateHooks
from ._ledger_lock import LedgerFileError, lock_ledger_file

_log = logging.getLogger("tokcap_vllm.ledger_file")

__all__ = ["LedgerFile", "LedgerFileError", "lock_ledger_file", "read_ledger_records"]

_RELEASE = b'{"release":'


def _encode_entry_record(rollout_id: str, entry: Entry) -> bytes:
    """One file line for ``entry`` of ``rollout_id`` (a one-entry manifest, newline-terminated)."""
    manifest = Manifest(
        rollout_id=rollout_id, entries=(entry,), head_seq=entry.seq, head_hash=entry.hash
    )
    return encode_manifest(manifest) + b"\n"


def _encode_release_record(rollout_id: str) -> bytes:
    """The file line that forgets ``rollout_id`` (its earlier entries are dropped on read)."""
    return json.dumps({"release": rollout_id}, separators=(",", ":")).encode("ascii") + b"\n"


def _decode_line(line: bytes) -> tuple[str, Entry | None]:
    if line.startswith(_RELEASE):
        body = json.loads(line)
        if not isinstance(body, dict) or set(body) != {"release"}:
            raise ValueError("bad release record")
        return validate_rollout_id(body["release"]), None
    manifest = decode_manifest(line)
    if len(manifest.entries) != 1 or manifest.head != (
        manifest.entries[0].seq,
        manifest.entries[0].hash,
    ):
        raise ValueError("an entry record holds exactly one entry, as its head")
    return manifest.rollout_id, manifest.entries[0]


def read_ledger_records(data: bytes) -> tuple[dict[str, list[Entry]], bool]:
    """The entries per rollout held in ledger-file bytes, and whether a torn tail was ignored.

    Rollouts come in order of first appearance; a released rollout is absent (unless it
    was used again after its release). Raises `LedgerFileError` (``corrupt_record``) for a
    bad record that is not the last one.
    """
    ledgers, kept = _read_records(data)
    return ledgers, kept < len(data)


def _read_records(data: bytes) -> tuple[dict[str, list[Entry]], int]:
    """The entries per rollout, and how many leading bytes hold whole, decodable records."""
    lines = data.split(b"\n")
    complete = lines[:-1]  # a file that ends with "\n" leaves b"" last
    ledgers: dict[str, list[Entry]] = {}
    kept = 0
    for number, line in enumerate(complete, start=1):
        try:
            rollout_id, entry = _decode_line(line)
        except (TokcapError, ValueError) as e:
            if number == len(complete) and lines[-1] == b"":
                break  # a garbled last record: a write the crash cut short
            raise LedgerFileError(
                "corrupt_record", f"ledger file record {number} does not decode ({e})"
            ) from e
        kept += len(line) + 1
        if entry is None:
            ledgers.pop(rollout_id, None)
        else:
            ledgers.setdefault(rollout_id, []).append(entry)
    return ledgers, kept


def _replay(ledgers: dict[str, list[Entry]]) -> list[Ledger]:
    out = []
    for rollout_id, entries in ledgers.items():
        try:
            out.append(Ledger.from_entries(rollout_id, entries))
        except VerificationError as e:
            raise LedgerFileError(
                "corrupt_ledger", f"the stored ledger of {rollout_id} does not replay ({e.code})"
            ) from e
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite(path: Path, lines: Iterable[bytes]) -> int:
    """Write ``lines`` to a fresh temp file next to ``path`` (fsync'ed); return its append fd."""
    tmp = path.with_name(path.name + ".compact")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    try:
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            chunk.append(line)
            size += len(line)
            if size >= 1 << 20:
                _write_all(fd, b"".join(chunk))
                chunk, size = [], 0
        _write_all(fd, b"".join(chunk))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lines_of(ledgers: Iterable[tuple[str, tuple[Entry, ...]]]) -> Iterable[bytes]:
    for rollout_id, entries in ledgers:
        for entry in entries:
            yield _encode_entry_record(rollout_id, entry)


class LedgerFile(GateHooks):
    """The gate's append-only ledger file (a `GateHooks`: `Gate` attaches it when configured).

    Build it with `open`, which reads the file, compacts it, and returns the ledgers found.
    """

    def __init__(
        self, path: Path, fd: int, size: int, *, compact_after_releases: int, lock: int = -1
    ) -> None:
        self.path = path
        self._lock_fd = lock
        self.compact_after_releases = compact_after_releases
        self.releases_since_compaction = 0
        self.records_written = 0
        self.write_failures = 0
        self.syncs = 0
        """How many fsyncs made appended records durable (a batch close costs one)."""
        self.recovery: str | None = None
        """What the start cut off a damaged file, and where the original is kept (or None)."""
        self.broken: str | None = None
        """Why the file can no longer be appended to (a failed write could not be cut back)."""
        self.last_write_failed: str | None = None
        """Why the latest write failed, until a write succeeds again: the file cannot grow
        now, so every rollout that writes is poisoned, whatever rollouts are held."""
        self._fd = fd
        self._size = size
        self._muted: dict[str, tuple[str, int]] = {}
        """Rollouts whose writes stopped: why, and the seq of their first entry not on file."""
        self._appended = 0
        self._synced = 0
        self._sync_lock = anyio.Lock()
        self._pending: list[bytes] | None = None
        self._compacting = False

    def __repr__(self) -> str:
        return f"LedgerFile({str(self.path)!r})"

    @property
    def torn_tail_ignored(self) -> bool:
        """Whether the start cut a torn or garbled last record off the file."""
        return self.recovery is not None

    @property
    def problem(self) -> str | None:
        """What health reports: the file is broken, its latest write failed, a held rollout
        is not fully on file, or the start recovered a damaged file (None: all is well)."""
        if self.broken is not None:
            return self.broken
        if self.last_write_failed is not None:
            return (
                f"ledger_write_failed: {self.last_write_failed}; rollouts that write now are "
                "poisoned (the problem clears at the next write that succeeds)"
            )
        if self._muted:
            return (
                f"ledger_write_failed: {len(self._muted)} held rollout(s) are not fully on "
                "file (poisoned; the problem clears once they are released)"
            )
        return self.recovery

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, compact_after_releases: int = 1024
    ) -> tuple[LedgerFile, list[Ledger]]:
        """Read ``path`` (created if missing), rewrite it compacted, and open it for appending.

        Returns the file and the stored ledgers (closed and still-open ones; the gate
        poisons the open ones). A torn tail is cut off, the damaged original kept as
        ``<name>.damaged-<ns>`` and a warning logged. `LedgerFileError`
        ``ledger_file_locked`` if another gate holds the file (`lock_ledger_file`).
        Blocking: call it at start.
        """
        target = Path(path)
        lock = lock_ledger_file(target)
        try:
            return cls._read_and_open(target, lock, compact_after_releases)
        except BaseException:
            os.close(lock)
            raise

    @classmethod
    def _read_and_open(
        cls, target: Path, lock: int, compact_after_releases: int
    ) -> tuple[LedgerFile, list[Ledger]]:
        data = target.read_bytes() if target.exists() else b""
        records, kept = _read_records(data)
        ledgers = _replay(records)
        recovery = None
        if kept < len(data):
            damaged = target.with_name(f"{target.name}.damaged-{time.time_ns()}")
            shutil.copyfile(target, damaged)
            recovery = (
                f"ledger_file_recovered: cut {len(data) - kept} byte(s) of a torn last record "
                f"after {kept} byte(s); the damaged file is kept as {damaged.name}"
            )
            _log.warning("tokcap ledger file %s: %s", target, recovery)
        lines = list(_lines_of((ledger.rollout_id, ledger.entries) for ledger in ledgers))
        fd = _rewrite(target, lines)
        os.replace(target.with_name(target.name + ".compact"), target)
        _fsync_dir(target)
        file = cls(
            target,
            fd,
            sum(map(len, lines)),
            compact_after_releases=compact_after_releases,
            lock=lock,
        )
        file.recovery = recovery
        return file, ledgers

    # ---- GateHooks ---------------------------------------------------------------------

    def on_entry(self, rollout_id: str, entry: Entry) -> None:
        """Append the entry's record (one write, no fsync); `LedgerFileError` if it failed."""
        self._append(_encode_entry_record(rollout_id, entry), rollout_id, entry.seq)

    def on_sink_write(self, call: StagedCall, seconds: float, error: str | None) -> None:
        """Nothing to persist: staging is the sink's business."""

    def on_release(self, rollout_id: str) -> None:
        """Append a release record; the rollout's entries go at the next compaction."""
        self._muted.pop(rollout_id, None)
        self._append(_encode_release_record(rollout_id), None, 0)
        self.releases_since_compaction += 1

    async def on_close(self, rollout_id: str) -> None:
        """Make every record written so far durable (fsync)."""
        await self.sync()

    # ---- durability and compaction -----------------------------------------------------

    def _append(self, record: bytes, rollout_id: str | None, seq: int) -> None:
        if self.broken is not None:
            raise LedgerFileError("ledger_write_failed", self.broken, "broken")
        if rollout_id is not None and rollout_id in self._muted:
            raise LedgerFileError("ledger_write_failed", self._muted[rollout_id][0], "muted")
        try:
            _write_all(self._fd, record)
        except OSError as e:
            self._write_failed(e, rollout_id, seq)
        self.last_write_failed = None
        self._size += len(record)
        if self._pending is not None:
            self._pending.append(record)
        self._appended += 1
        self.records_written += 1

    def _write_failed(self, error: OSError, rollout_id: str | None, seq: int) -> None:
        name = errno.errorcode.get(error.errno or 0, str(error.errno))
        reason = f"a ledger-file write failed ({name})"
        self.write_failures += 1
        self.last_write_failed = reason
        if rollout_id is not None:
            self._muted[rollout_id] = (reason, seq)
        try:
            os.ftruncate(self._fd, self._size)  # cut the partial record back off
        except OSError as cut:
            self.broken = (
                f"ledger_file_broken: a failed write ({name}) could not be cut back "
                f"({errno.errorcode.get(cut.errno or 0, cut.errno)})"
            )
            _log.error("tokcap ledger file %s: %s", self.path, self.broken)
        raise LedgerFileError("ledger_write_failed", reason, name) from error

    async def sync(self) -> None:
        """fsync everything appended so far (concurrent callers share one fsync).

        Raises `LedgerFileError` ``ledger_sync_failed`` if the fsync failed. (A rollout
        whose records could not be written was poisoned when that happened; its close
        still answers, with a head that only this process can vouch for.)
        """
        target = self._appended
        async with self._sync_lock:
            if self._synced < target:
                upto = self._appended
                try:
                    await anyio.to_thread.run_sync(os.fsync, self._fd)
                except OSError as e:
                    name = errno.errorcode.get(e.errno or 0, str(e.errno))
                    raise LedgerFileError(
                        "ledger_sync_failed", f"fsync of the ledger file failed ({name})", name
                    ) from e
                self._synced = upto
                self.syncs += 1

    @property
    def compacting(self) -> bool:
        """Whether a compaction is under way."""
        return self._compacting

    @property
    def should_compact(self) -> bool:
        """Whether enough rollouts were released since the last compaction."""
        return self.releases_since_compaction >= self.compact_after_releases

    async def compact(self, held: Callable[[], Iterable[Ledger]]) -> None:
        """Rewrite the file with the ledgers ``held()`` returns (the gate's open and closed ones).

        The snapshot is encoded and written in a worker thread; records appended meanwhile
        go to the old file *and* are copied to the new one before the rename. A rollout
        whose writes failed keeps only the records it had on file.
        """
        if self._compacting or self.broken is not None:
            return
        self._compacting = True
        try:
            snapshot = [(ledger.rollout_id, self._on_file(ledger)) for ledger in held()]
            self._pending = []
            self.releases_since_compaction = 0
            lines = list(_lines_of(snapshot))
            fd = await anyio.to_thread.run_sync(_rewrite, self.path, lines)
            async with self._sync_lock:
                try:
                    pending = b"".join(self._pending)
                    _write_all(fd, pending)
                    os.replace(self.path.with_name(self.path.name + ".compact"), self.path)
                except BaseException:
                    os.close(fd)
                    raise
                old, self._fd = self._fd, fd
                self._size = sum(map(len, lines)) + len(pending)
                self._pending = None
                os.close(old)
                upto = self._appended
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._fsync_new, fd)
                self._synced = upto
        finally:
            self._pending = None
            self._compacting = False

    def _on_file(self, ledger: Ledger) -> tuple[Entry, ...]:
        """The entries of ``ledger`` the file holds (all of them unless its writes stopped)."""
        muted = self._muted.get(ledger.rollout_id)
        if muted is None:
            return ledger.entries
        return tuple(e for e in ledger.entries if e.seq < muted[1])

    def sync_blocking(self) -> None:
        """fsync now, blocking (at start, before the event loop serves anything)."""
        os.fsync(self._fd)
        self._synced = self._appended

    def _fsync_new(self, fd: int) -> None:
        os.fsync(fd)
        _fsync_dir(self.path)

    def close(self) -> None:
        """Close the file descriptor (records already written stay) and let the lock go."""
        os.close(self._fd)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
