"""This machine's process table, read from ``/proc`` (Linux), for tests that must find the
Ray and TransferQueue processes *this* test session started among everyone else's (and
for the benchmarks' ``bench/_procmem.py``, which measures this run's processes)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["descendants", "process_table"]


def process_table() -> dict[int, tuple[int, bytes]]:
    """``pid -> (parent pid, process title)`` of every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry.name)] = (ppid, title)
    return out


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in process_table().items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen
