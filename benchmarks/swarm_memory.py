"""What a peer of the main job costs in memory: its main process plus its helper processes, by PSS.

Runs ALBERT's local swarm (``examples/albert/train.py`` with ``examples/albert/configs/swarm.yaml``: a local swarm
of 4 peer processes, 2 stages) for ``--steps`` steps and samples every process of the job every second from
``/proc/<pid>/smaps_rollup``. PSS (proportional set size) splits pages shared between processes (the forked
helpers share most of their parent's memory) so that the sum over processes is the real footprint. Each process
is attributed to its peer by the ``LOCAL_RANK`` its environment started with (the launcher gives it to each peer
process; hivemind's forked helpers and p2p daemons inherit it).

The last stdout line is one JSON object: for each peer the peak (over samples) of its total PSS and its split into
main process, forked helpers (DHT, averagers) and p2p daemons; the mean peak per peer; and the peak number of
processes per peer. ``--quick``: 30 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(root: int) -> dict[int, int]:
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


def _rank(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"LOCAL_RANK="):
                    return item.split(b"=", 1)[1].decode()
    except OSError:
        pass
    return "0"


def _kind(pid: int, parent: int, ranks: dict[int, str], root: int) -> str:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        exe = "?"
    if "p2pd" in exe:
        return "p2pd"
    if pid == root or ranks.get(parent) != ranks[pid]:
        return "main"  # the job's first process, or a peer process the launcher started
    return "helpers"


def sample(root: int) -> dict[str, dict[str, float]]:
    tree = _descendants(root)
    ranks = {pid: _rank(pid) for pid in tree}
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pid, parent in tree.items():
        kind = _kind(pid, parent, ranks, root)
        mb = _pss_kb(pid) / 1024
        out[ranks[pid]][kind] += mb
        out[ranks[pid]]["processes"] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (30 if args.quick else 100)
    cmd = [
        sys.executable,
        "examples/albert/train.py",
        "fit",
        "--config",
        "examples/albert/configs/swarm.yaml",
    ]
    cmd += [
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
    ]
    start = time.monotonic()
    log = tempfile.TemporaryFile(mode="w+")  # a pipe left unread would fill up and stall the job
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
    peaks: dict[str, dict[str, float]] = {}
    try:
        while proc.poll() is None:
            for rank, parts in sample(proc.pid).items():
                total = parts["main"] + parts["helpers"] + parts["p2pd"]
                if total > peaks.get(rank, {}).get("total_mb", 0.0):
                    peaks[rank] = {k: round(v, 1) for k, v in parts.items()} | {"total_mb": round(total, 1)}
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.seek(0)
        stderr = log.read()
        log.close()
    if proc.returncode != 0:
        print(stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"the main job failed (exit code {proc.returncode})")
    per_peer = [p["total_mb"] for p in peaks.values()]
    result = {
        "peers": {rank: peaks[rank] for rank in sorted(peaks)},
        "mean_peer_total_mb": round(sum(per_peer) / max(len(per_peer), 1), 1),
        "mean_peer_main_mb": round(sum(p.get("main", 0) for p in peaks.values()) / max(len(peaks), 1), 1),
        "steps": steps,
        "seconds": round(time.monotonic() - start, 1),
        "tracebacks_in_output": stderr.count("Traceback"),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
