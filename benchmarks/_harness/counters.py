"""Byte and CPU counters read from ``/proc`` and ``/sys``, for the process that calls them.

Bytes on a shaped link: inside a rank's namespace its veth is ``eth0`` (``testbed/netns.py``); the host side
counts per rank with ``VirtualCluster.tx_bytes(rank)``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def link_bytes(
    directions: tuple[str, ...] = ("tx", "rx"), dev: str = "eth0", in_namespace_only: bool = True
) -> int | None:
    """Bytes this namespace's ``dev`` has sent and/or received so far (sum over ``directions``); None when not in
    a rank's namespace (``in_namespace_only``: ``VirtualCluster.popen`` sets ``GLOO_SOCKET_IFNAME=eth0``) or when
    the device has no counters."""
    if in_namespace_only and os.environ.get("GLOO_SOCKET_IFNAME") != dev:
        return None
    try:
        base = Path(f"/sys/class/net/{dev}/statistics")
        return sum(int((base / f"{d}_bytes").read_text()) for d in directions)
    except OSError:
        return None


def _stat_fields(stat: str) -> list[str]:
    return stat[stat.rfind(")") + 2 :].split()  # state, ppid, pgrp, session, ..., utime (11), stime (12)


def cpu_snapshot(sessions: set[int]) -> dict[int, tuple[str, float, int]]:
    """pid -> (name, CPU seconds so far, minor page faults so far) of every process in the given sessions (a
    worker and its helpers)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        close = stat.rfind(")")
        fields = _stat_fields(stat)
        if int(fields[3]) in sessions:
            cpu = (int(fields[11]) + int(fields[12])) / tick
            out[int(entry)] = (stat[stat.find("(") + 1 : close], cpu, int(fields[7]))
    return out


def cpu_split(before: dict, after: dict, mains: dict[int, str], field: int = 1) -> dict[str, float]:
    """CPU seconds spent between two :func:`cpu_snapshot` s (``field=2``: minor page faults taken), by kind of
    process: the named main processes, p2p daemons and the other (hivemind helper) processes."""
    split: dict[str, float] = {}
    for pid, entry in after.items():
        name = entry[0]
        kind = mains.get(pid) or ("p2pd" if name == "p2pd" else "helper_processes")
        used = entry[field] - before.get(pid, (name, 0.0, 0))[field]
        split[kind] = split.get(kind, 0.0) + used
    return split


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each live Python thread of this process, by thread name (native threads that are not
    Python threads, e.g. torch's or the codec's, are counted together as ``other_native_threads``)."""
    tick = os.sysconf("SC_CLK_TCK")
    by_tid = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = _stat_fields(stat)
        name = by_tid.get(int(tid), "other_native_threads")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out
