"""A push file: every tensor's bytes back to back in one file, described by JSON entries.

The trainer writes it into shared memory (``/dev/shm``) on the engine's host, or streams
its bytes to the gate, which writes the same file there; the worker reads it into a buffer
of its own (kept across pushes of a trainer's file) and hands vLLM's loader tensors that
view the buffer, never decoded. A trainer that pushes again and again keeps one `PushFile`
and rewrites it in place: a fresh file's shared-memory pages are allocated (4 KiB each,
zeroed) on every push, which cost more than the copy itself. Entries are
``[name, dtype, shape, offset, nbytes]`` (JSON-native: they ride vLLM's ``/update_weights``
body). Offsets are 64-byte aligned.

What a worker reads is checked (`open_push_file`, `check_push_file`; each refusal a
`WeightPushError` with its code, nothing read): the path is absolute and its last component
named ``tokcap-push-*`` (read as written: no link is resolved to check it), opened without
following a link (``O_NOFOLLOW``) and without blocking (``O_NONBLOCK``: a FIFO cannot stall
the engine), a regular file with one link (no FIFO, device, directory, or hard link to some
other file) whose size is exactly where its entries end. The bytes are **read**, not mapped:
a file shrunk while a mapping of it is in use kills the process that touches the lost pages
(SIGBUS, even for private copies: the kernel unmaps them on truncate), so a mapping would let
any writer of the file take the engine down. A read that comes up short, or a file whose
identity (inode, size, modification time) changed while it was read, is refused
(``push_file_changed``), and so is a finish whose files changed since they were read
(`unchanged_since`): the bytes loaded are the bytes checked. The cost is one copy of the
file per push into memory the worker keeps (`KeptBuffers`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ._weight_state import WeightPushError

if TYPE_CHECKING:
    import torch

    from ._spec import TensorSpec

__all__ = [
    "KEPT_PREFIX",
    "PUSH_PREFIX",
    "SHM_DIR",
    "Entry",
    "FileIdentity",
    "KeptBuffers",
    "PushBuffer",
    "PushFile",
    "check_entries",
    "check_push_file",
    "entries_end",
    "entries_for",
    "joined",
    "open_push_file",
    "read_push_file",
    "tensor_bytes",
    "unchanged_since",
    "write_push_file",
]

SHM_DIR: Final = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where push files go by default: shared memory when the host has it."""
PUSH_PREFIX: Final = "tokcap-push-"
KEPT_PREFIX: Final = PUSH_PREFIX + "pid"
"""How a `PushFile`'s name starts: a file rewritten in place push after push."""
_ALIGN: Final = 64
_READ_CHUNK: Final = 64 << 20

Entry = list[Any]
"""``[name, dtype name without "torch.", shape, offset, nbytes]``."""
FileIdentity = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns)`` of a push file as it was read."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, not copied."""
    import torch

    view: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data
    return view


def entries_for(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[Entry], int]:
    """The entries of a push file holding ``tensors`` in order, and the file's size."""
    entries: list[Entry] = []
    offset = end = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append([name, dtype, list(tensor.shape), offset, nbytes])
        end = offset + nbytes
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, end


def file_chunks(
    tensors: Sequence[tuple[str, torch.Tensor]], entries: Sequence[Entry]
) -> Iterator[bytes | memoryview]:
    """The file's bytes in order (tensor bytes not copied; zero padding between them)."""
    position = 0
    for (_, tensor), (_, _, _, offset, nbytes) in zip(tensors, entries, strict=True):
        if offset > position:
            yield bytes(offset - position)
        yield tensor_bytes(tensor)
        position = offset + nbytes


def write_push_file(
    tensors: Sequence[tuple[str, torch.Tensor]], folder: str = SHM_DIR
) -> tuple[str, list[Entry]]:
    """Write a new push file for ``tensors`` (contiguous, CPU) in ``folder``: (path, entries)."""
    entries, size = entries_for(tensors)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=PUSH_PREFIX, delete=False) as f:
        try:
            os.ftruncate(f.fileno(), size)
            for chunk in file_chunks(tensors, entries):
                f.write(chunk)
        except BaseException:
            os.unlink(f.name)
            raise
    return f.name, entries


class PushFile:
    """One push file kept across pushes in ``folder`` and rewritten in place (its pages
    stay allocated; resized when the state dict's size changes); `remove` deletes it, as
    does the end of the process. It holds one state dict's worth of shared memory while it
    lives; a process killed with SIGKILL leaves it behind (``tokcap-push-pid<PID>-*``)."""

    def __init__(self, folder: str = SHM_DIR) -> None:
        self.folder = folder
        self.path: str | None = None
        self._finalizer: weakref.finalize[Any, PushFile] | None = None

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, list[Entry]]:
        """Write ``tensors`` (contiguous, CPU) over the file's contents: (path, entries)."""
        entries, size = entries_for(tensors)
        fd = self._open()
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            position = 0
            for chunk in file_chunks(tensors, entries):
                view = memoryview(chunk).cast("B")
                while view:
                    written = os.pwrite(fd, view, position)
                    position += written
                    view = view[written:]
        finally:
            os.close(fd)
        assert self.path is not None
        return self.path, entries

    def remove(self) -> None:
        """Delete the file (the next `write` makes a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self.path, self._finalizer = None, None

    def _open(self) -> int:
        if self.path is not None:
            try:
                return os.open(self.path, os.O_RDWR)
            except FileNotFoundError:  # someone removed it: start a new one
                self.remove()
        prefix = f"{KEPT_PREFIX}{os.getpid()}-"
        fd, self.path = tempfile.mkstemp(dir=self.folder, prefix=prefix)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        return fd


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def check_entries(
    entries: Sequence[Sequence[Any]], spec: Mapping[str, TensorSpec], size: int
) -> None:
    """`WeightPushError` unless every entry names a tensor of ``spec`` once, with its dtype,
    shape and byte count, inside a file of ``size`` bytes (``bad_entry``,
    ``unknown_tensors``, ``duplicate_tensors``, ``shape_mismatch``, ``entry_out_of_file``)."""
    import torch

    seen: set[str] = set()
    for entry in entries:
        try:
            name, dtype, shape, offset, nbytes = entry
        except (TypeError, ValueError):
            name = shape = None
        if (
            not isinstance(name, str)
            or not isinstance(shape, list | tuple)
            or not all(type(n) is int for n in shape)
        ):
            raise WeightPushError(
                "bad_entry", f"an entry is [name, dtype, shape, offset, nbytes]: {entry!r}"[:300]
            )
        expected = spec.get(name)
        if expected is None:
            raise WeightPushError("unknown_tensors", f"unknown tensor {name!r}")
        if name in seen:
            raise WeightPushError("duplicate_tensors", f"{name} is in the push twice")
        seen.add(name)
        if (dtype, tuple(shape)) != expected:
            raise WeightPushError(
                "shape_mismatch",
                f"{name} is {dtype}{list(shape)}, the engine expects "
                f"{expected[0]}{list(expected[1])}",
            )
        itemsize = getattr(torch, dtype).itemsize
        numel = 1
        for n in expected[1]:
            numel *= n
        if (
            type(offset) is not int
            or type(nbytes) is not int
            or nbytes != numel * itemsize
            or offset < 0
            or offset + nbytes > size
        ):
            raise WeightPushError(
                "entry_out_of_file", f"{name}: {nbytes} bytes at {offset} do not fit the file"
            )


def entries_end(entries: Sequence[Sequence[Any]]) -> int:
    """Where the last of ``entries`` ends: the size of the file that holds exactly them."""
    return max((int(entry[3]) + int(entry[4]) for entry in entries), default=0)


def open_push_file(path: str) -> int:
    """A read-only descriptor of push file ``path`` (see the module); `WeightPushError`
    ``push_file_name``, ``push_file_missing``, ``push_file_link``, ``push_file_not_regular``,
    ``push_file_linked`` or ``push_file_unreadable``, nothing opened."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise WeightPushError("push_file_name", f"a push file's path is absolute: {path!r}"[:300])
    if not os.path.basename(path).startswith(PUSH_PREFIX):
        raise WeightPushError("push_file_name", f"{path} is not a tokcap push file"[:300])
    try:
        mode = os.lstat(path).st_mode  # refused before any open (a device, a link)
        if stat.S_ISLNK(mode):
            raise WeightPushError("push_file_link", f"{path} is a symbolic link")
        if not stat.S_ISREG(mode):
            raise WeightPushError("push_file_not_regular", f"{path} is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise WeightPushError("push_file_missing", f"no push file {path}") from None
    except OSError as e:
        code = "push_file_link" if e.errno == errno.ELOOP else "push_file_unreadable"
        raise WeightPushError(code, f"{path}: {e.strerror}") from None
    info = os.fstat(fd)  # what was opened, whatever the name points at now
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = WeightPushError("push_file_not_regular", f"{path} is not a regular file")
    elif info.st_nlink != 1:
        problem = WeightPushError("push_file_linked", f"{path} has {info.st_nlink} links")
    if problem is not None:
        os.close(fd)
        raise problem
    return fd


def _opened(
    path: str, entries: Sequence[Sequence[Any]], spec: Mapping[str, TensorSpec]
) -> tuple[int, os.stat_result]:
    fd = open_push_file(path)
    try:
        info = os.fstat(fd)
        check_entries(entries, spec, info.st_size)
        if info.st_size != entries_end(entries):
            raise WeightPushError(
                "push_file_size",
                f"{path} is {info.st_size} bytes; its entries end at {entries_end(entries)}",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def check_push_file(
    path: str, entries: Sequence[Sequence[Any]], spec: Mapping[str, TensorSpec]
) -> None:
    """`WeightPushError` unless ``path`` is a push file holding exactly ``entries`` of
    ``spec`` (what a worker would read; the gate asks before vLLM sees an update)."""
    fd, _ = _opened(path, entries, spec)
    os.close(fd)


def _identity(info: os.stat_result) -> FileIdentity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def unchanged_since(path: str, identity: FileIdentity) -> None:
    """`WeightPushError` ``push_file_changed`` unless ``path`` (not followed) is still the
    file read with ``identity``: same inode, size and modification time."""
    try:
        now = _identity(os.lstat(path))
    except OSError:
        now = (-1, -1, -1, -1)
    if now != identity:
        raise WeightPushError("push_file_changed", f"{path} changed after it was read")


class PushBuffer:
    """One push file read into this process: ``base`` holds its bytes (every tensor handed
    out views it, so tensors back to back in the file can be viewed as one, `joined`);
    ``identity`` is the file's as read. Kept, the buffer takes the next read of a file of
    the same size (its pages are already allocated)."""

    __slots__ = ("base", "identity", "path")

    def __init__(self, path: str, identity: FileIdentity, base: torch.Tensor) -> None:
        self.path = path
        self.identity = identity
        self.base = base

    def views(self, entries: Sequence[Sequence[Any]]) -> list[tuple[str, torch.Tensor]]:
        """A tensor viewing the buffer for each (checked) entry."""
        import torch

        tensors = []
        for name, dtype, shape, offset, nbytes in entries:
            kind = getattr(torch, dtype)
            if nbytes == 0:
                tensors.append((name, torch.empty(tuple(shape), dtype=kind)))
                continue
            flat = self.base[offset : offset + nbytes].view(kind)
            tensors.append((name, flat.view(tuple(shape))))
        return tensors


class KeptBuffers:
    """The buffers of trainers' push files (`PushFile`, named ``KEPT_PREFIX...``), kept
    between pushes so that a file rewritten in place is read into pages already allocated:
    at most ``limit`` (a trainer with a one-gate client and a fleet has two files; each holds
    a model's worth of memory), each dropped as soon as a push finds its file removed or
    replaced. Uploads are never kept (the gate removes them)."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._kept: dict[str, PushBuffer] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def read(
        self, path: str, entries: Sequence[Sequence[Any]], spec: Mapping[str, TensorSpec]
    ) -> tuple[list[tuple[str, torch.Tensor]], FileIdentity]:
        """`read_push_file`, reusing and keeping buffers as the class says; the tensors and
        the identity of the file they were read from."""
        for other, kept in list(self._kept.items()):
            if other != path and not _same_inode(other, kept.identity):
                del self._kept[other]
        tensors, buffer = read_push_file(path, entries, spec, previous=self._kept.pop(path, None))
        if buffer is None:
            return tensors, (0, 0, 0, 0)
        if Path(path).name.startswith(KEPT_PREFIX):
            self._kept[path] = buffer  # the most recent last
            while len(self._kept) > self.limit:
                del self._kept[next(iter(self._kept))]
        return tensors, buffer.identity

    def clear(self) -> None:
        """Drop every buffer."""
        self._kept.clear()


def _same_inode(path: str, identity: FileIdentity) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == identity[:2]


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(parts)`` as a view, when the contiguous ``parts`` lie back to back in one
    storage with one dtype and the same trailing shape; else None."""
    import torch

    first = parts[0]
    end = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for part in parts:
        same = (
            part.dtype == first.dtype
            and part.shape[1:] == first.shape[1:]
            and part.is_contiguous()
            and part.untyped_storage().data_ptr() == storage
        )
        if not same or part.data_ptr() != end:
            return None
        end += part.numel() * part.element_size()
    shape = (sum(int(p.shape[0]) for p in parts), *first.shape[1:])
    return torch.as_strided(first, shape, first.stride(), first.storage_offset())


def read_push_file(
    path: str,
    entries: Sequence[Sequence[Any]],
    spec: Mapping[str, TensorSpec],
    previous: PushBuffer | None = None,
) -> tuple[list[tuple[str, torch.Tensor]], PushBuffer | None]:
    """Tensors viewing the bytes of push file ``path`` read into this process (the file
    checked first, see the module), and the buffer they view (None for an empty file).

    ``previous`` lends its buffer when it has the file's size. Raises `WeightPushError`
    (the file's refusals, `check_entries`'s, ``push_file_changed``); nothing is kept then.
    """
    import torch

    fd, before = _opened(path, entries, spec)
    try:
        size = before.st_size
        if size == 0:
            return [
                (name, torch.empty(tuple(shape), dtype=getattr(torch, dtype)))
                for name, dtype, shape, _, _ in entries
            ], None
        if previous is not None and previous.base.numel() == size:
            base = previous.base
        else:
            base = torch.empty(size, dtype=torch.uint8)
        view = memoryview(base.numpy().data).cast("B")
        position = 0
        while position < size:
            got = os.preadv(fd, [view[position : position + _READ_CHUNK]], position)
            if got <= 0:
                break
            position += got
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if position != size or _identity(after) != _identity(before):
        raise WeightPushError("push_file_changed", f"{path} changed while it was read")
    buffer = PushBuffer(path, _identity(before), base)
    return buffer.views(entries), buffer
