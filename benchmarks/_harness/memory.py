"""Memory figures of processes, read from ``/proc``: PSS (``smaps_rollup``), RSS and peak RSS (``VmRSS``,
``VmHWM``), ``ru_maxrss``, the tree of a process's descendants and the memory this machine has available; and the
growth of a process's memory over a run (a least-squares slope through its samples).

Which figure a benchmark reports is its own choice and is named in its JSON: ``VmHWM`` is a process's own peak;
``ru_maxrss`` is carried across ``exec`` from the process that forked, so a child reports at least its parent's
peak at the fork; PSS splits the pages processes share, so that it adds up over a job's processes.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from pathlib import Path

# the most a swarm peer's memory (with its helper processes) may grow over a long run (hivemind's averager has been
# reported to grow by gigabytes per hour)
GROWTH_TARGET_MB_PER_HOUR = 50.0


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


def tree_pss_mb(root: int) -> float:
    """The memory of ``root`` with every process below it (its helpers): the sum of their PSS, in MB."""
    return sum(pss_kb(pid) for pid in descendants(root)) / 1024.0


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """The slope of the least-squares line through ``(seconds, MB)`` points, in MB per hour."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mm = sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 3600.0 * sum((t - mt) * (m - mm) for t, m in points) / var if var else 0.0


def growth_in_window(
    samples: Mapping[str, list[tuple[float, float]]], first: float, last: float
) -> tuple[dict[str, float], dict[str, list[float]], dict[str, int]]:
    """Per peer of ``samples`` (peer: its ``(seconds, MB)`` samples), over the samples taken from ``first`` to
    ``last`` (seconds): the growth in MB per hour (:func:`slope_per_hour`, rounded), the memory at the first and the
    last of them (MB) and how many there were. A peer with fewer than 3 such samples has no growth and memory."""
    growth, ends, counts = {}, {}, {}
    for peer, points in samples.items():
        kept = [(t, m) for t, m in points if first <= t <= last]
        counts[peer] = len(kept)
        if len(kept) >= 3:
            growth[peer] = round(slope_per_hour(kept), 1)
            ends[peer] = [round(kept[0][1], 1), round(kept[-1][1], 1)]
    return growth, ends, counts


def available_mb() -> float:
    """``MemAvailable`` of this machine in MB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024.0
    return 0.0
