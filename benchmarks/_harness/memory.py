"""Memory figures of processes, read from ``/proc``: PSS (``smaps_rollup``), RSS and peak RSS (``VmRSS``,
``VmHWM``), ``ru_maxrss``, the tree of a process's descendants and the memory this machine has available.

Which figure a benchmark reports is its own choice and is named in its JSON: ``VmHWM`` is a process's own peak;
``ru_maxrss`` is carried across ``exec`` from the process that forked, so a child reports at least its parent's
peak at the fork; PSS splits the pages processes share, so that it adds up over a job's processes.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path


def _status_kb(field: str, pid: int | str = "self") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def vm_hwm_mb(pid: int | str = "self") -> float:
    """Peak resident memory (``VmHWM``) in MB; this process's ``ru_maxrss`` if ``/proc`` has none."""
    kb = _status_kb("VmHWM", pid)
    return kb / 1024.0 if kb is not None else ru_maxrss_mb()


def vm_rss_mb(pid: int | str = "self") -> float:
    """Resident memory (``VmRSS``) in MB; 0.0 when the process is gone."""
    kb = _status_kb("VmRSS", pid)
    return kb / 1024.0 if kb is not None else 0.0


def ru_maxrss_mb() -> float:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in MB (see the module docstring for what it counts)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def pss_kb(pid: int) -> int:
    """Proportional set size of ``pid`` in kB (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of ``root`` and every process below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except OSError:
                continue
    tree, frontier = {root: parents.get(root, 0)}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree[child] = parent
                frontier.append(child)
    return tree


def available_mb() -> float:
    """``MemAvailable`` of this machine in MB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024.0
    return 0.0
