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
    "PUSH_PREFIX",
    "SHM_DIR",
    "Entry",
    "PushFile",
    "check_entries",
    "entries_for",
    "map_push_file",
    "tensor_bytes",
    "write_push_file",
]

SHM_DIR: Final = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where push files go by default: shared memory when the host has it."""
PUSH_PREFIX: Final = "tokcap-push-"
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
        prefix = f"{PUSH_PREFIX}pid{os.getpid()}-"
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


def map_push_file(
    path: str, entries: Sequence[Sequence[Any]], spec: Mapping[str, TensorSpec]
) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing push file ``path`` (checked with `check_entries` first).

    The mapping is private and writable (copy-on-write) so torch takes it without a warning;
    it lives as long as the tensors do, even after the file is unlinked. Until a tensor is
    written, its pages are the file's: the file must not change while the tensors are in
    use (a trainer rewrites its `PushFile` only for its next push, after the load).
    """
    import torch

    if not Path(path).name.startswith(PUSH_PREFIX):
        raise ValueError(f"{path} is not a tokcap push file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        check_entries(entries, spec, size)
        if size == 0:
            return []
        # Not MAP_POPULATE: on a private writable mapping it faults every page in for
        # writing, i.e. copies the whole file. Populating for reading copies nothing.
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=prot)
        with contextlib.suppress(OSError):  # Linux < 5.14: pages fault in as read
            mapped.madvise(_MADV_POPULATE_READ)
    tensors = []
    for name, dtype, shape, offset, nbytes in entries:
        kind = getattr(torch, dtype)
        if nbytes == 0:
            tensors.append((name, torch.empty(tuple(shape), dtype=kind)))
            continue
        flat = torch.frombuffer(mapped, dtype=kind, count=nbytes // kind.itemsize, offset=offset)
        tensors.append((name, flat.view(tuple(shape))))
    return tensors
