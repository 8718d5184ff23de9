"""A push file: every tensor's bytes back to back in one file, described by JSON entries.

The trainer writes it into shared memory (``/dev/shm``) on the engine's host, or streams
its bytes to the gate, which writes the same file there; the worker maps it (private,
copy-on-write, page tables populated for reading: no page is copied) and hands vLLM's
loader tensors that view the mapping, so the bytes are copied once on each side, never
decoded. A trainer that pushes again and again keeps one `PushFile` and rewrites it in
place: a fresh file's shared-memory pages are allocated (4 KiB each, zeroed) on every
push, which cost more than the copy itself. Entries are
``[name, dtype, shape, offset, nbytes]`` (JSON-native: they ride vLLM's ``/update_weights``
body). Offsets are 64-byte aligned. Only files named ``tokcap-push-*`` are ever mapped, so
an update cannot make a worker read an arbitrary file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

    from ._spec import TensorSpec

__all__ = [
    "KEPT_PREFIX",
    "PUSH_PREFIX",
    "SHM_DIR",
    "Entry",
    "KeptMappings",
    "PushFile",
    "PushMapping",
    "check_entries",
    "entries_for",
    "joined",
    "map_push_file",
    "tensor_bytes",
    "write_push_file",
]

SHM_DIR: Final = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where push files go by default: shared memory when the host has it."""
PUSH_PREFIX: Final = "tokcap-push-"
KEPT_PREFIX: Final = PUSH_PREFIX + "pid"
"""How a `PushFile`'s name starts: a file rewritten in place push after push."""
_ALIGN: Final = 64
_MADV_POPULATE_READ: Final = 22
"""Linux's ``MADV_POPULATE_READ`` (5.14+; Python 3.11's mmap does not name it)."""

Entry = list[Any]
"""``[name, dtype name without "torch.", shape, offset, nbytes]``."""


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
    """Raise `ValueError` unless every entry names a tensor of ``spec`` once, with its dtype,
    shape and byte count, inside a file of ``size`` bytes."""
    import torch

    seen: set[str] = set()
    for entry in entries:
        name, dtype, shape, offset, nbytes = entry
        expected = spec.get(name)
        if expected is None:
            raise ValueError(f"unknown tensor {name!r}")
        if name in seen:
            raise ValueError(f"{name} is in the push twice")
        seen.add(name)
        if (dtype, tuple(shape)) != expected:
            raise ValueError(
                f"{name} is {dtype}{list(shape)}, the engine expects "
                f"{expected[0]}{list(expected[1])}"
            )
        itemsize = getattr(torch, dtype).itemsize
        numel = 1
        for n in shape:
            numel *= int(n)
        if nbytes != numel * itemsize or offset < 0 or offset + nbytes > size:
            raise ValueError(f"{name}: {nbytes} bytes at {offset} do not fit the file")


class PushMapping:
    """One push file mapped into this process (private, copy-on-write, its pages populated
    for reading: no page is copied), kept so that the next push of the same file maps
    nothing again (`map_push_file` with ``previous``).

    ``base`` is the whole file as bytes; every tensor handed out views it, so tensors that
    lie back to back in the file can be viewed as one (`joined`). The mapping lives as long
    as any of its tensors, even after the file is unlinked.
    """

    __slots__ = ("_identity", "base", "path")

    def __init__(self, path: str, identity: tuple[int, int, int], base: torch.Tensor) -> None:
        self.path = path
        self._identity = identity
        self.base = base

    def same_file(self, path: str, identity: tuple[int, int, int]) -> bool:
        """True when ``path`` is still the file this maps: same device, inode and size (a
        trainer rewrites its `PushFile` in place; the mapping then shows the new bytes)."""
        return path == self.path and identity == self._identity

    def views(self, entries: Sequence[Sequence[Any]]) -> list[tuple[str, torch.Tensor]]:
        """A tensor viewing the file for each (checked) entry."""
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


class KeptMappings:
    """The mappings of trainers' push files (`PushFile`, named ``KEPT_PREFIX...``), kept
    between pushes so that a file rewritten in place is not mapped again: at most ``limit``
    (a trainer with a one-gate client and a fleet has two files), each dropped as soon as a
    push finds its file removed, replaced or resized, so a mapping holds a removed file's
    memory at most until the next push. Uploads are never kept (the gate removes them)."""

    def __init__(self, limit: int = 4) -> None:
        self.limit = limit
        self._kept: dict[str, PushMapping] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def map(
        self, path: str, entries: Sequence[Sequence[Any]], spec: Mapping[str, TensorSpec]
    ) -> list[tuple[str, torch.Tensor]]:
        """`map_push_file`, reusing and keeping mappings as the class says."""
        for other, mapping in list(self._kept.items()):
            if other != path and not mapping.same_file(other, _identity(other)):
                del self._kept[other]
        tensors, fresh = map_push_file(path, entries, spec, previous=self._kept.pop(path, None))
        if fresh is not None and Path(path).name.startswith(KEPT_PREFIX):
            self._kept[path] = fresh  # the most recent last
            while len(self._kept) > self.limit:
                del self._kept[next(iter(self._kept))]
        return tensors

    def clear(self) -> None:
        """Drop every mapping."""
        self._kept.clear()


def _identity(path: str) -> tuple[int, int, int]:
    try:
        stat = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (stat.st_dev, stat.st_ino, stat.st_size)


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


def map_push_file(
    path: str,
    entries: Sequence[Sequence[Any]],
    spec: Mapping[str, TensorSpec],
    previous: PushMapping | None = None,
) -> tuple[list[tuple[str, torch.Tensor]], PushMapping | None]:
    """Tensors viewing push file ``path`` (checked with `check_entries` first), and the
    mapping they view (None for an empty file).

    ``previous`` is reused when it maps the same file (`PushMapping.same_file`): mapping and
    populating a large file costs ~0.1 ms per MB, paid once for a trainer that rewrites one
    file push after push. A file replaced or resized is mapped again. The mapping is private
    and writable (copy-on-write) so torch takes it without a warning. Until a tensor is
    written, its pages are the file's: the file must not change while the tensors are in
    use (a trainer rewrites its `PushFile` only for its next push, after the load).
    """
    import torch

    if not Path(path).name.startswith(PUSH_PREFIX):
        raise ValueError(f"{path} is not a tokcap push file")
    with open(path, "rb") as f:
        stat = os.fstat(f.fileno())
        size = stat.st_size
        check_entries(entries, spec, size)
        if size == 0:
            return [
                (name, torch.empty(tuple(shape), dtype=getattr(torch, dtype)))
                for name, dtype, shape, _, _ in entries
            ], None
        identity = (stat.st_dev, stat.st_ino, size)
        if previous is not None and previous.same_file(path, identity):
            return previous.views(entries), previous
        # Not MAP_POPULATE: on a private writable mapping it faults every page in for
        # writing, i.e. copies the whole file. Populating for reading copies nothing.
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=prot)
        with contextlib.suppress(OSError):  # Linux < 5.14: pages fault in as read
            mapped.madvise(_MADV_POPULATE_READ)
    mapping = PushMapping(path, identity, torch.frombuffer(mapped, dtype=torch.uint8))
    return mapping.views(entries), mapping
