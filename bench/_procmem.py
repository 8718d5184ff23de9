"""Memory of this process and the processes it started, read from ``/proc`` (Linux).

vLLM's engine core, Ray's GCS and raylet and every Ray worker (TransferQueue's controller
and storage units, reassembler actors) descend from the benchmark's process, so walking
its descendants finds exactly this run's processes even when other clusters share the box.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # our tests/, not TQ's stray one
from tests.procs import descendants as process_tree

__all__ = ["cpu_seconds", "descendants", "memory_by_role", "role_of", "status_mib"]


def status_mib(field: str, pid: int | str = "self") -> float:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status`` in MiB (NaN if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds ``pid`` has used so far, all its threads (NaN if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(root: int | None = None) -> list[int]:
    """Every live process below ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    return sorted(process_tree(root) - {root})


def role_of(pid: int) -> str:
    """A short name for a descendant: ``engine core``, ``raylet``, ``gcs``, a Ray actor's
    class (``ray::TransferQueueController``), ``ray idle worker`` or ``other``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "EngineCore" in cmdline:
        return "engine core"
    if "raylet" in cmdline.split(" ", 1)[0]:
        return "raylet"
    if "gcs_server" in cmdline.split(" ", 1)[0]:
        return "gcs"
    if cmdline.startswith("ray::"):
        name = cmdline[5:].split(" ", 1)[0].split(".", 1)[0]
        return "ray idle worker" if name == "IDLE" else f"ray::{name}"
    return "other"


def memory_by_role(field: str = "VmRSS") -> dict[str, float]:
    """``{"driver": MiB, role: MiB summed over its processes, ...}`` for this run."""
    out = {"driver": status_mib(field)}
    for pid in descendants():
        role = role_of(pid)
        value = status_mib(field, pid)
        if role != "gone" and value == value:  # NaN: the process ended meanwhile
            out[role] = out.get(role, 0.0) + value
    return out
