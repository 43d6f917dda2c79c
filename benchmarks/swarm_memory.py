"""What a peer of the main job costs in memory: its main process plus its helper processes, by PSS.

Runs ALBERT's local swarm (``examples/albert/train.py`` with ``examples/albert/configs/swarm.yaml``: a local swarm
of 4 peer processes, 2 stages) for ``--steps`` steps and samples every process of the job every second from
``/proc/<pid>/smaps_rollup``. PSS (proportional set size) splits pages shared between processes (the forked
helpers share most of their parent's memory) so that the sum over processes is the real footprint. Each process
is attributed to its peer by the ``LOCAL_RANK`` its environment started with (the launcher gives it to each peer
process; hivemind's forked helpers and p2p daemons inherit it).

The last stdout line is one JSON object: for each peer the peak (over samples) of its total PSS and its split into
main process, forked helpers (DHT, averagers) and p2p daemons; the mean peak per peer; and the peak number of
processes per peer. ``--quick``: 30 steps. Also written to ``runs/swarm_memory/swarm_memory.json`` (``--scale``:
``runs/swarm_memory_scale/swarm_memory_scale.json``; ``--out``).

``--scale``: models larger than one peer (``testbed/memory_job.py``). An MLP pipeline (16 blocks of width 2048
and FFN 8192: 537M parameters; ``--quick``: width 1024, FFN 4096, 134M) trained with Adam for a few steps by one
plain Lightning process, then by a local swarm of 4 peers, 4 stages of one peer each (one trainer), once for each
way of building the model: in ``__init__`` (``init``), under ``trainer.init_module(empty_init=True)``
(``init_module``), in ``configure_model``. Each run is sampled every 0.2 s; the last stdout line holds ``params``,
``peak_mb_single`` (the plain process's peak PSS), ``floor_mb`` (the PSS of a process that imported torch,
Lightning and this project) and, per way, ``peak_mb_per_peer`` (the worst peer's peak PSS, its main process plus
its helper processes), its split, ``ratio`` (worst peer / single) and each peer's ``VmHWM``. ``--capped`` adds a run
of each peer (``init_module``) and of the plain process in a memory cgroup (v1, needs root) limited to 0.45 x
``peak_mb_single``: ``capped_swarm_completed`` and ``capped_single_completed``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import _harness
from _harness.memory import descendants, pss_kb

ROOT = _harness.ROOT


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
    tree = descendants(root)
    ranks = {pid: _rank(pid) for pid in tree}
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pid, parent in tree.items():
        kind = _kind(pid, parent, ranks, root)
        mb = pss_kb(pid) / 1024
        out[ranks[pid]][kind] += mb
        out[ranks[pid]]["processes"] += 1
    return out


def run_sampled(
    cmd: list[str], interval: float, timeout: float = float("inf"), env: dict[str, str] | None = None
) -> tuple[int | None, dict[str, dict[str, float]], str]:
    """Run the job ``cmd`` (from the repository root), sampling its processes every ``interval`` s until it exits
    (or ``timeout`` s pass: then it is killed); returns its exit code, per peer the sample of the largest total PSS
    (main process + helpers + p2p daemons) split by kind, and its stderr."""
    log = tempfile.TemporaryFile(mode="w+")  # a pipe left unread would fill up and stall the job
    proc = _harness.popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    peaks: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for rank, parts in sample(proc.pid).items():
                total = parts["main"] + parts["helpers"] + parts["p2pd"]
                if total > peaks.get(rank, {}).get("total_mb", 0.0):
                    peaks[rank] = {k: round(v, 1) for k, v in parts.items()} | {"total_mb": round(total, 1)}
            time.sleep(interval)
    finally:
        if proc.poll() is None:
            _harness.kill_group(proc)
        log.seek(0)
        stderr = log.read()
        log.close()
    return proc.returncode, peaks, stderr


SCALE_TARGETS = {"init": 0.5, "init_module": 0.35, "configure_model": 0.35}
CGROUP_ROOT = "/sys/fs/cgroup/memory"


def _floor_mb() -> float:
    """PSS of a process that imported torch, Lightning and this project, and nothing more."""
    code = (
        "import torch, lightning.pytorch, lightning_swarm, time, sys; sys.stdout.write('ready\\n'); "
        "sys.stdout.flush(); time.sleep(30)"
    )
    proc = _harness.popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        time.sleep(0.5)
        return round(pss_kb(proc.pid) / 1024, 1)
    finally:
        _harness.kill_group(proc)


def _run_job(cfg: dict, timeout: float, cgroup_mb: float | None = None) -> dict:
    """Run ``testbed/memory_job.py`` with ``cfg``, sampling its processes' PSS; returns the peaks per peer, the peers'
    reports and whether it completed."""
    out_dir = tempfile.mkdtemp(prefix="swarm-memory-")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    if cgroup_mb is not None:
        env["SWARM_MEMORY_CGROUP"] = f"{CGROUP_ROOT}/swarm_memory_{os.getpid()}:{int(cgroup_mb * 2**20)}"
    cmd = [sys.executable, "testbed/memory_job.py", json.dumps({**cfg, "out_dir": out_dir})]
    returncode, peaks, stderr = run_sampled(cmd, 0.2, timeout, env=env)
    reports = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                reports[name[4:-5]] = json.load(f)
    if cgroup_mb is not None:  # the processes are gone: their cgroups can go
        root = env["SWARM_MEMORY_CGROUP"].rsplit(":", 1)[0]
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith("peer"):
                _rmdir_when_empty(os.path.join(root, name))
        _rmdir_when_empty(root)
    completed = returncode == 0 and all("vm_hwm_mb" in r for r in reports.values()) and bool(reports)
    return {"peaks": peaks, "reports": reports, "completed": completed, "stderr": stderr}


def _rmdir_when_empty(path: str, timeout: float = 20.0) -> None:
    """Remove a cgroup directory once the processes left in it (helpers ending) are gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return
        except OSError:
            if time.monotonic() > deadline:
                print(f"could not remove the cgroup {path}", file=sys.stderr)
                return
            time.sleep(0.5)


def scale(quick: bool, capped: bool, report: _harness.Report) -> None:
    sizes = (
        {"width": 1024, "ffn": 4096, "blocks": 16} if quick else {"width": 2048, "ffn": 8192, "blocks": 16}
    )
    base = {**sizes, "steps": 3, "batch": 8, "seed": 0, "compression": "none"}
    width, ffn, blocks = sizes["width"], sizes["ffn"], sizes["blocks"]
    params = blocks * (2 * width * ffn + ffn + 3 * width) + width * width + width + width + 1
    start = time.monotonic()
    result: dict = {"params": params, "sizes": sizes, "floor_mb": _floor_mb()}
    single = _run_job({**base, "way": "init", "devices": 1}, timeout=1800)
    if not single["completed"]:
        print(single["stderr"][-6000:], file=sys.stderr)
        raise SystemExit("the single-process run failed")
    result["peak_mb_single"] = single["peaks"]["0"]["total_mb"]
    result["vm_hwm_mb_single"] = round(single["reports"]["0"]["vm_hwm_mb"], 1)
    tracebacks = 0
    for way in ("init", "init_module", "configure_model"):
        run = _run_job({**base, "way": way, "devices": 4, "run_id": f"scale_{way}"}, timeout=1800)
        tracebacks += run["stderr"].count("Traceback")
        if not run["completed"]:
            print(run["stderr"][-6000:], file=sys.stderr)
            raise SystemExit(f"the swarm run built with {way!r} failed")
        worst = max(run["peaks"].values(), key=lambda p: p["total_mb"])
        result[way] = {
            "peak_mb_per_peer": worst["total_mb"],
            "worst_peer": {k: v for k, v in worst.items() if k != "total_mb"},
            "ratio": round(worst["total_mb"] / result["peak_mb_single"], 3),
            "target": SCALE_TARGETS[way],
            "peers_peak_mb": {r: p["total_mb"] for r, p in sorted(run["peaks"].items())},
            "peers_vm_hwm_mb": {r: round(rep["vm_hwm_mb"], 1) for r, rep in sorted(run["reports"].items())},
            "stage_model_mb": round(max(rep["model_bytes"] for rep in run["reports"].values()) / 2**20, 1),
            "server_extra_mb": round(
                max(rep.get("server_extra_bytes", 0) for rep in run["reports"].values()) / 2**20, 1
            ),
        }
    if capped:
        limit = 0.45 * result["peak_mb_single"]
        result["cap_mb"] = round(limit, 1)
        swarm = _run_job({**base, "way": "init_module", "devices": 4, "run_id": "scale_capped"}, 1800, limit)
        plain = _run_job({**base, "way": "init", "devices": 1}, 1800, limit)
        result["capped_swarm_completed"] = swarm["completed"]
        result["capped_single_completed"] = plain["completed"]
    result["seconds"] = round(time.monotonic() - start, 1)
    result["tracebacks_in_output"] = tracebacks
    result["loadavg"] = os.getloadavg()
    report.finish(result)


def main() -> None:
    parser = _harness.parser(
        "swarm_memory",
        __doc__.split("\n\n")[0],
        quick="30 steps (--scale: width 1024, FFN 4096: 134M parameters)",
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--scale", action="store_true", help="models larger than one peer (see the docstring)"
    )
    parser.add_argument("--capped", action="store_true", help="with --scale: also the memory-capped runs")
    args = parser.parse_args()
    report = _harness.Report("swarm_memory_scale" if args.scale else "swarm_memory", args.out)
    if args.scale:
        scale(args.quick, args.capped, report)
        return
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
    returncode, peaks, stderr = run_sampled(cmd, 1.0)
    if returncode != 0:
        print(stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"the main job failed (exit code {returncode})")
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
    report.finish(result)


if __name__ == "__main__":
    main()
