"""A swarm against torch's GPipe restarted from checkpoints, under repeated kills and with a half-speed peer.

Two comparisons: under repeated kills of a last-stage process, and with one last-stage process at half speed.

The model is ``testbed/stage_peer.py``'s small MLP: 2 stages of 2 blocks of ``Linear(256, 256)`` + ``Tanh``
(``stage_module``, the same initial weights in both jobs), microbatches of 16 random rows, loss ``output.pow(2).mean()``, ``Adam(lr=1e-3)``
stepping once per 256 samples (the stage peers' ``target_batch_size``). Both jobs run on this box's cores (2 on
the benchmark machine, shared with everything else on it), over loopback, with one torch thread per process.

- **Swarm**: 2 stages x 2 server peers (``stage_peer.py`` processes; each has a DHT helper and a p2p daemon), and
  one trainer (this process) keeping ``--concurrency`` microbatches in flight, each routed whole
  (``microbatches=1``: GPipe's microbatch size) through one peer per stage (forward, then backward; a failed call is
  retried on the other peer of the stage). Its figure is committed samples, as GPipe's: the samples of the
  optimizer steps that both stages took, counting only the microbatches whose gradients the step could hold. A
  microbatch that failed does not count, nor does any microbatch of a step that failed; and since a killed stage-1
  peer takes with it the gradients it accumulated since the step began, a step during which a peer was killed
  counts only the microbatches completed after the kill (a lower bound: those that went to the surviving peer
  before it are left out too). ``throughput_faults_swarm_completed`` is the count of every completed microbatch,
  for reference. (With ``--swarm-steps async`` the trainer does not see the stages' steps: its figure is the
  completed microbatches less ``target_batch_size`` = 256 samples per kill, the most a killed peer can hold.)
- **GPipe**: ``torch.distributed.pipelining.ScheduleGPipe`` over gloo on 127.0.0.1, 2 ranks (one per stage) of
  one torch thread each, on the same 2 cores (not pinned, like the swarm's processes): one rank per core, no
  data-parallel replica and no standby rank (``benchmarks/_harness/gpipe_job.py``): a pipeline
  step is ``--concurrency`` microbatches (the swarm's microbatches in flight), 256 / (16 x concurrency) pipeline
  steps accumulate into one optimizer step. Every N optimizer steps each rank saves its stage's model and Adam
  state (``torch.save`` to a temporary file, then a rename); a restarted job resumes from the last step that both
  ranks saved. Its figure is committed samples: (last step reached at the end - step at the start) x 256 / time,
  so steps redone after a restart count once (at the end of a phase, a job that is restarting counts its last
  checkpoint). A gloo job cannot replace a rank: when either rank dies the supervisor (this process) kills the
  other and starts both again from the checkpoint, which is what a user of torch pipelining must do; the restart
  (interpreter, torch import, rendezvous, checkpoint load) is measured (``gpipe_restart_s``: kill to both ranks
  ready; ``gpipe_recovery_s``: kill to the step reached before the kill).

**N for GPipe** is tuned for it: a healthy run without checkpoints gives its step time, one checkpointing every
step gives the checkpoint cost C (``torch.save`` + rename, the slower rank's median), and N = Young's optimum
sqrt(2 C T_kill) / step time (at least 1). Without ``--quick`` the fault phase is also run with N / 4 and 4 N, and
``throughput_faults_gpipe`` is GPipe's best of the three (``gpipe_sweep``).

**Faults.** One process of the last stage is SIGKILLed every kill period (60 s; 30 s with ``--quick``), the first
at the start of the fault phase, which is 4 kill periods (2 with ``--quick``); the same schedule for both jobs.
Swarm: one stage-1 server is killed and a replacement started at once (a preempted machine coming back; its
start-up is its downtime, ``downtime_s``), on the same cores as everything else. GPipe: rank 1 is killed and the
job restarted as above. ``speedup_vs_gpipe_faults`` = ``throughput_faults_swarm`` / ``throughput_faults_gpipe``
(target >= 1.5); ``retained`` (the swarm's) and ``retained_gpipe`` = throughput with faults / without.

**Heterogeneous peers** (no kills). One stage-1 process runs at half speed: it and its children are started in
a cgroup (v1, ``/sys/fs/cgroup/cpu/swarm_bench_slow_<pid>``, removed at the end) capped at half a core
(``cpu.cfs_quota_us`` 50000 per 100000). Swarm: stage 0 has one peer, stage 1 the slow peer and a normal one:
the swarm's answer to a slow machine is a second peer on its stage, and a single stage-0 peer keeps the rest as
GPipe's (one process per stage). GPipe is given the same machines: its stage-1 rank is the slow one; and since a
user of GPipe would rather leave the slow machine out, GPipe is also run on the fast processes alone (one normal
process per stage, no checkpoints): ``speedup_vs_gpipe_hetero_fast_only``.
``speedup_vs_gpipe_hetero`` = swarm samples/s / GPipe samples/s (target >= 1.3), where GPipe checkpoints every N
steps as in the fault phase (the N tuned for the kill period: a job that expects kills saves, killed or not);
``speedup_vs_gpipe_hetero_no_checkpoints`` is the same against GPipe without checkpoints (a job that expects no
kill; at ``--quick --width 2048 --blocks 4`` N is 2 and its saves cost GPipe about a quarter of its speed, so this
is the stricter figure). The healthy GPipe (a normal stage-1 rank) is the reference; ``slow_cgroup_throttled``
says how often the quota bit.

Usage: ``python benchmarks/swarm_faults.py [--quick] [--width 256] [--blocks 2] [--out DIR]`` (``--width`` and
``--blocks`` size the MLP of both jobs: at the default size a microbatch computes in well under a millisecond, so
the swarm's per-call costs decide its speed; a larger model shows the compute-bound case). The last stdout line is one JSON object with
``throughput_faults_swarm``, ``throughput_faults_gpipe``, ``speedup_vs_gpipe_faults``, ``throughput_hetero_swarm``,
``throughput_hetero_gpipe``, ``speedup_vs_gpipe_hetero``, ``throughput_healthy_swarm``, ``throughput_healthy_gpipe``,
``gpipe_checkpoint_every_steps``, ``gpipe_restart_s``, ``kills``, ``retained`` and more; it is also written to
``runs/swarm_faults/swarm_faults.json``, with ``swarm_faults.png`` (committed samples/s of both jobs over the
fault phase, kills marked) next to it, and the GPipe ranks' logs (gloo errors after a kill are expected there).
Needs root for the cgroup (the heterogeneous part is skipped, with a note, without it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _harness
import hivemind
import torch

from lightning_swarm.swarm import SwarmClient, SwarmSettings
from lightning_swarm.swarm.lifetime import die_with_parent
from lightning_swarm.swarm.logs import quiet_routine_logs
from lightning_swarm.swarm.training.stepping import StepCommand
from lightning_swarm.swarm.wire.protocol import stage_uid
from testbed.stage_peer import stage_module

ROOT = _harness.ROOT
PEER = ROOT / "testbed" / "stage_peer.py"
GPIPE_JOB = ROOT / "benchmarks" / "_harness" / "gpipe_job.py"
WIDTH, BLOCKS, BATCH, LR, TARGET_BATCH = 256, 2, 16, 1e-3, 256
TIMEOUTS = {"request_timeout": 15.0, "matchmaking_time": 1.0, "averaging_timeout": 5.0}
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")


# ----------------------------------------------------------------------------------- half-speed processes
class SlowCgroup:
    """A cgroup v1 CPU group capped at ``quota`` of one core; a context manager that removes it (its processes, all
    ours, are killed first) on every exit path."""

    def __init__(self, quota: float = 0.5, period_us: int = 100_000) -> None:
        self.path = CGROUP_ROOT / f"swarm_bench_slow_{os.getpid()}"
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(period_us))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(quota * period_us)))

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd``, started inside the group (so are the processes it forks): the shell joins it, then execs."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *cmd]

    def stats(self) -> dict[str, int]:
        pairs = (line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return {k: int(v) for k, v in pairs}

    def __enter__(self) -> SlowCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        for _ in range(50):
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"could not remove {self.path}", file=sys.stderr)


# ----------------------------------------------------------------------------------- the swarm
class Peer:
    def __init__(self, cfg: dict, cgroup: SlowCgroup | None = None) -> None:
        cmd = [sys.executable, str(PEER), json.dumps(cfg)]
        self.proc = _harness.popen(
            cgroup.wrap(cmd) if cgroup else cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if os.environ.get("SWARM_FAULTS_VERBOSE") else subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )

        self.peer_id = ""

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a stage peer failed to start (exit code {self.proc.poll()})")
        try:
            self.peer_id = json.loads(line)["peer_id"]
        except (ValueError, KeyError):
            pass

    def kill(self) -> None:
        _harness.kill_group(self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            _harness.stop_with_stdin(self.proc, timeout=20)


class Trainer:
    """``concurrency`` threads, each running forward + backward microbatches through both stages. ``driven``: the
    trainer commands the stages' steps (``stage_steps="trainer"``, the library's default with one trainer): every
    ``TARGET_BATCH`` samples the threads finish their microbatches and both stages step (each stage's peers sum
    their gradients first), as GPipe's ranks step after their accumulated microbatches; else the stages step on
    their own every ``TARGET_BATCH`` samples (``stage_steps="async"``, hivemind's averaging rounds)."""

    def __init__(self, client: SwarmClient, concurrency: int, driven: bool = False) -> None:
        self.client, self.concurrency, self.driven = client, concurrency, driven
        self.done: list[float] = []  # completion time of every microbatch
        self.kills: list[float] = []  # when a stage peer was SIGKILLed (``Swarm.replace``)
        self.committed: list[
            tuple[float, int]
        ] = []  # per optimizer step taken: when, and the samples it holds
        self.errors = 0
        self.steps = 0
        self.step_errors = 0
        self._epochs: dict[int, int] = {}
        self._step_ids = itertools.count(secrets.randbits(62))
        self._stop = threading.Event()
        if driven:
            self._threads = [threading.Thread(target=self._drive, daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(concurrency)]

    def _one(self) -> float | None:
        """One microbatch forward and backward through both stages; when it completed (``None``: it failed)."""
        x = torch.randn(BATCH, WIDTH)  # data, as GPipe's: no input gradient to compute and send back
        try:
            self.client.call_stage(1, self.client.call_stage(0, x)).pow(2).mean().backward()
        except Exception:
            self.errors += 1
            return None
        done = time.monotonic()
        self.done.append(done)
        return done

    def _work(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            self._one()

    def _drive(self) -> None:
        torch.set_num_threads(1)
        per_step = TARGET_BATCH // BATCH
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="microbatch") as pool:
            while not self._stop.is_set():
                began = time.monotonic()
                completed = [future.result() for future in [pool.submit(self._one) for _ in range(per_step)]]
                if self._stop.is_set():
                    return
                step_id = next(self._step_ids)
                run_id = self.client.settings.run_id
                commands = {
                    k: StepCommand(stage_uid(run_id, k), step_id, phase="apply", epoch=self._epochs.get(k, 0))
                    for k in range(2)
                }
                steps = {k: pool.submit(self.client.commands.step_stage, k, c) for k, c in commands.items()}
                try:
                    for k, future in steps.items():
                        self._epochs[k] = max(int(r["epoch"]) for r in future.result())
                    self.steps += 1
                except Exception:
                    self.step_errors += 1  # none of its microbatches counts
                    continue
                committed = time.monotonic()
                # a peer killed during the step took the gradients it held: count what completed after the kill
                killed = max((k for k in self.kills if began <= k <= committed), default=-math.inf)
                held = sum(1 for t in completed if t is not None and t > killed)
                self.committed.append((committed, held * BATCH))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def rate(self, start: float, end: float) -> float:
        """Samples per second of the microbatches completed in ``[start, end)``."""
        return sum(start <= t < end for t in self.done) * BATCH / (end - start)

    def committed_rate(self, start: float, end: float) -> float:
        """Samples per second of the optimizer steps committed in ``[start, end)`` (trainer-driven steps), each
        counting the microbatches whose gradients it holds; the completed microbatches' rate without them."""
        if not self.driven:
            return self.rate(start, end)
        return sum(n for t, n in self.committed if start <= t < end) / (end - start)


class Swarm:
    """Stage peers (``layout``: per stage, how many; ``slow``: one stage-1 peer in that cgroup) and a trainer."""

    def __init__(
        self, args: argparse.Namespace, dht: hivemind.DHT, name: str, layout: tuple[int, int], slow=None
    ) -> None:
        self.args, self.dht = args, dht
        run_id = f"faults_{name}_{os.getpid()}"
        self.base = {
            "run_id": run_id,
            "num_stages": 2,
            "width": WIDTH,
            "blocks": BLOCKS,
            "lr": LR,
            "target_batch_size": TARGET_BATCH,
            "initial_peers": [str(a) for a in dht.get_visible_maddrs()],
            "stage_steps": args.swarm_steps,
            **TIMEOUTS,
        }
        self.peers: dict[tuple[int, int], Peer] = {}
        self.client: SwarmClient | None = None
        self.trainer: Trainer | None = None
        try:
            for k in range(2):
                for i in range(layout[k]):
                    cgroup = slow if (slow is not None and k == 1 and i == 0) else None
                    self.peers[k, i] = Peer({**self.base, "stage": k}, cgroup)
            for peer in self.peers.values():
                peer.wait_ready()
            settings = SwarmSettings(
                run_id=run_id,
                num_stages=2,
                compression="8bit",
                # whole microbatches: the trainer keeps ``concurrency`` of them in flight, as GPipe's pipeline
                # step does ("auto" would too, but for a call made while no other is out, such as the first of a
                # step, which it would cut into 8-row chunks: GPipe's microbatches are 16 rows)
                microbatches=1,
                no_peers_timeout=120.0,
                stage_steps=args.swarm_steps,
                **TIMEOUTS,
            )
            self.client = SwarmClient(dht, settings)
            self.trainer = Trainer(self.client, args.concurrency, driven=args.swarm_steps == "trainer")
            self.trainer.start()
            deadline = time.monotonic() + 180  # connections open, first steps done (slow on a busy box)
            while len(self.trainer.done) < 4 * args.concurrency and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(args.warmup)
        except BaseException:
            self.close()
            raise

    def replace(self, key: tuple[int, int]) -> dict:
        """SIGKILL peer ``key`` and start a replacement at once; returns ``{"killed": time, "back": time}``, where
        ``back`` (when the replacement serves) is filled in by a thread, so that the kill schedule goes on."""
        record: dict = {"killed": time.monotonic(), "back": None}
        if self.trainer is not None:
            self.trainer.kills.append(record["killed"])
        self.peers[key].kill()
        self.peers[key] = peer = Peer({**self.base, "stage": key[0]})

        def wait() -> None:
            try:
                peer.wait_ready()
                record["back"] = time.monotonic()
            except (RuntimeError, ValueError):
                pass

        threading.Thread(target=wait, daemon=True).start()
        return record

    def close(self) -> dict:
        stats = {}
        if self.trainer is not None:
            self.trainer.stop()
        if self.client is not None:
            stats = self.client.stats()
            self.client.shutdown()
        for peer in self.peers.values():
            peer.stop()
        return stats


def run_swarm(args: argparse.Namespace, dht: hivemind.DHT) -> dict:
    """Healthy, then the fault phase: every kill period one stage-1 server SIGKILLed, a replacement started."""
    swarm = Swarm(args, dht, "swarm", (2, 2))
    records: list[dict] = []
    try:
        t0 = time.monotonic()
        time.sleep(args.phase)
        t1 = time.monotonic()
        for k in range(args.kills):
            _sleep_until(t1 + k * args.period)
            records.append(swarm.replace((1, 0)))
        t2 = t1 + args.kills * args.period
        _sleep_until(t2)
    finally:
        stats = swarm.close()
    trainer = swarm.trainer
    faults = trainer.committed_rate(t1, t2)
    # a peer is down from its kill until its replacement serves (or, killed before it served, until the next one
    # does: the intervals' union)
    downs = [(r["killed"], min(r["back"] or t2, t2)) for r in records]
    down, reach = 0.0, t1
    for a, b in downs:
        down += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    if (
        not trainer.driven
    ):  # the trainer does not see the stages' steps: the most a killed peer can hold, less
        faults -= len(downs) * TARGET_BATCH / (t2 - t1)
    return {
        "healthy": trainer.committed_rate(t0, t1),
        "faults": faults,
        "faults_completed": trainer.rate(t1, t2),
        "kills": len(downs),
        "down_fraction": down / (t2 - t1),
        "downtime_s": [round(b - a, 2) for a, b in downs],
        "retries": stats.get("swarm/retries", 0),
        "failed_microbatches": trainer.errors,
        "steps": trainer.steps,
        "step_errors": trainer.step_errors,
        "series": [
            (t - t1, trainer.committed_rate(t, t + args.bin)) for t in _frange(t1, t2 - args.bin, args.bin)
        ],
        "kills_at": [a - t1 for a, _ in downs],
        "downs": [(a - t1, b - t1) for a, b in downs],
    }


def run_swarm_hetero(args: argparse.Namespace, dht: hivemind.DHT, slow: SlowCgroup) -> dict:
    swarm = Swarm(args, dht, "hetero", (1, 2), slow=slow)
    try:
        t0 = time.monotonic()
        time.sleep(args.phase)
        t1 = time.monotonic()
        # what the trainer's router believes of the stage-1 peers (samples/s), which sets their shares of the work
        slow_id = swarm.peers[1, 0].peer_id
        believed = {str(p): v for p, v in swarm.client.routers[1].peers.items()}
        routed = {
            "slow": _r(believed.pop(slow_id, None), 1),
            "normal": [_r(v, 1) for v in believed.values()],
        }
    finally:
        swarm.close()
    return {
        "throughput": swarm.trainer.committed_rate(t0, t1),
        "errors": swarm.trainer.errors,
        "routed": routed,
    }


# ----------------------------------------------------------------------------------- GPipe
class GPipeJob:
    """A 2-rank GPipe job (``gpipe_job.py``) with its checkpoints in ``dir``; started, killed and restarted as a
    whole. ``slow``: rank 1 runs in that cgroup."""

    def __init__(self, args: argparse.Namespace, out: Path, name: str, every: int, slow=None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"swarm_faults_{name}_"))
        (self.dir / "ckpt").mkdir()
        for k in range(2):  # the same initial weights as the stage peers'
            state = {"model": stage_module(k, WIDTH, BLOCKS).state_dict(), "optimizer": None, "step": 0}
            torch.save(state, self.dir / "ckpt" / f"rank{k}_step0.pt")
        self.cfg = {
            "dir": str(self.dir),
            "width": WIDTH,
            "blocks": BLOCKS,
            "batch": BATCH,
            "microbatches": args.concurrency,
            "accumulate": TARGET_BATCH // (BATCH * args.concurrency),
            "lr": LR,
            "every": every,
        }
        self.samples_per_step = BATCH * args.concurrency * self.cfg["accumulate"]
        self.slow = slow
        self.log = open(out / f"gpipe_{name}.log", "w")  # noqa: SIM115 (closed in close)
        self.ranks: list[subprocess.Popen] = []
        self.starts = 0

    def start(self) -> None:
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.log.write(f"--- start {self.starts} at {time.monotonic():.3f} ---\n")
        self.log.flush()
        for rank in range(2):
            cmd = [sys.executable, str(GPIPE_JOB), json.dumps({**self.cfg, "rank": rank, "port": port})]
            if self.slow is not None and rank == 1:
                cmd = self.slow.wrap(cmd)
            self.ranks.append(
                _harness.popen(
                    cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )
            )
        self.starts += 1

    def dead(self) -> bool:
        return any(r.poll() is not None for r in self.ranks)

    def kill_rank(self, rank: int) -> None:
        self.ranks[rank].send_signal(signal.SIGKILL)

    def kill_all(self) -> None:
        for r in self.ranks:
            _harness.kill_group(r)
        self.ranks = []

    def restart(self) -> None:
        self.kill_all()
        self.start()

    def events(self, rank: int) -> list[tuple[str, int, float]]:
        path = self.dir / f"events_rank{rank}.txt"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            parts = line.split()
            if len(parts) == 3:  # a line being written is skipped
                try:
                    out.append((parts[0], int(parts[1]), float(parts[2])))
                except ValueError:
                    pass
        return out

    def last_checkpoint(self) -> int:
        steps: dict[int, int] = {}
        for f in (self.dir / "ckpt").glob("rank*_step*.pt"):
            s = int(f.stem.split("_step")[1])
            steps[s] = steps.get(s, 0) + 1
        return max((s for s, n in steps.items() if n == 2), default=0)

    def committed(self) -> int:
        """The step the job has reached: both ranks' last step in the running incarnation, or the last
        checkpoint while it is down or restarting."""
        reached = []
        for rank in range(2):
            ev = self.events(rank)
            resumes = [i for i, e in enumerate(ev) if e[0] == "resume"]
            if self.dead() or len(resumes) < self.starts:
                return self.last_checkpoint()
            after = ev[resumes[-1] :]
            reached.append(max(s for kind, s, _ in after if kind in ("resume", "step")))
        return min(reached)

    def wait_steps(self, steps: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.committed() < steps:
            if self.dead():
                raise RuntimeError(f"a GPipe rank died on its own; log: {self.log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"GPipe made no progress in {timeout:.0f} s; log: {self.log.name}")
            time.sleep(0.2)

    def close(self) -> None:
        self.kill_all()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_gpipe(
    args: argparse.Namespace, out: Path, name: str, every: int, duration: float, kill_period=None, slow=None
) -> dict:
    """One GPipe job: warm-up, then ``duration`` seconds, with rank 1 SIGKILLed every ``kill_period`` (the first at
    the start) and the job restarted whenever a rank dies."""
    job = GPipeJob(args, out, name, every, slow)
    kills: list[float] = []
    try:
        job.start()
        job.wait_steps(3)
        time.sleep(args.warmup)
        t0 = time.monotonic()
        base = job.committed()
        t1 = t0 + duration
        next_kill = t0 if kill_period else math.inf
        while (now := time.monotonic()) < t1:
            if job.dead():
                job.restart()
            elif now >= next_kill:
                job.kill_rank(1)
                kills.append(now)
                next_kill += kill_period
            time.sleep(0.02)
        end = job.committed()
        ev = [job.events(r) for r in range(2)]
    finally:
        job.close()
    sps = job.samples_per_step
    result = {
        "throughput": (end - base) * sps / duration,
        "every": every,
        "steps": end - base,
        "kills": len(kills),
        "samples_per_step": sps,
    }
    steps = [(t, s) for kind, s, t in ev[0] if kind == "step"]  # rank 0 ends a step last
    timed = [t for t, _ in steps if t0 <= t < t1]
    if len(timed) > 2 and not kills:
        result["step_s"] = statistics.median(b - a for a, b in zip(timed, timed[1:], strict=False))
    saves = [[s for kind, _, s in e if kind == "ckpt"] for e in ev]
    if all(saves):
        result["checkpoint_s"] = max(statistics.median(v) for v in saves)
    if kills:

        def reached(t: float) -> int:  # the highest step reached by ``t``: a redone step never counts twice
            return max((s for u, s in steps if u <= t), default=base)

        resumes = [[t for kind, _, t in e if kind == "resume"] for e in ev]
        restart, recovery = [], []
        for k in kills:
            after = [min(t for t in r if t > k) for r in resumes if any(t > k for t in r)]
            if len(after) == 2:
                restart.append(max(after) - k)
                before = reached(k)
                back = [t for t, s in steps if t > max(after) and s >= before]
                if back:
                    recovery.append(min(back) - k)
        result["restart_s"] = restart
        result["recovery_s"] = recovery
        result["series"] = [
            (t - t0, (reached(t + args.bin) - reached(t)) * sps / args.bin)
            for t in _frange(t0, t1 - args.bin, args.bin)
        ]
        result["kills_at"] = [k - t0 for k in kills]
    return result


# ----------------------------------------------------------------------------------- helpers, plot, main
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _frange(start: float, stop: float, step: float) -> list[float]:
    out, t = [], start
    while t <= stop:
        out.append(t)
        t += step
    return out


def plot(swarm: dict, gpipe: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(
        [t for t, _ in swarm["series"]], [v for _, v in swarm["series"]], label="swarm (2 peers per stage)"
    )
    ax.plot(
        [t for t, _ in gpipe["series"]],
        [v for _, v in gpipe["series"]],
        label=f"GPipe, checkpoint every {gpipe['every']} steps",
    )
    for t in swarm["kills_at"]:
        ax.axvline(t, color="red", alpha=0.4)
    for a, b in swarm["downs"]:
        ax.axvspan(a, b, color="red", alpha=0.1)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("committed samples/s")
    ax.set_xlabel(
        "seconds into the fault phase (red: a last-stage process SIGKILLed; shaded: swarm peer down)"
    )
    ax.set_title(
        f"swarm / GPipe samples/s under faults: {summary['speedup_vs_gpipe_faults']}; "
        f"swarm retained {summary['retained']}, GPipe {summary['retained_gpipe']}"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def main() -> None:
    global WIDTH, BLOCKS  # the model of both jobs (set from the arguments, read where they are built)
    parser = _harness.parser(
        "swarm_faults",
        __doc__.splitlines()[0],
        quick="short phases and a 30 s kill period, no sweep of GPipe's checkpoint interval (about 7 minutes)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="microbatches in flight")
    parser.add_argument("--width", type=int, default=WIDTH, help="hidden size of the MLP blocks")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks per stage")
    parser.add_argument(
        "--swarm-steps",
        choices=("trainer", "async"),
        default="trainer",
        help="the stages step when the trainer commands it (one trainer's default) or on their own",
    )
    args = parser.parse_args()
    WIDTH, BLOCKS = args.width, args.blocks
    _harness.exit_on_sigterm()
    report = _harness.Report("swarm_faults", args.out)
    out = report.path("")
    args.period = 30.0 if args.quick else 60.0  # kill period
    args.kills = 2 if args.quick else 4  # the fault phase is this many kill periods
    args.phase = 20.0 if args.quick else 60.0  # healthy and heterogeneous phases
    args.warmup = 2.0 if args.quick else 10.0
    args.bin = 2.0
    fault_s = args.kills * args.period
    die_with_parent()
    quiet_routine_logs()
    torch.set_num_threads(1)

    # GPipe: healthy, the checkpoint cost, N, faults
    g_healthy = run_gpipe(args, out, "healthy", 10**9, args.phase)
    g_every1 = run_gpipe(args, out, "every1", 1, args.phase / 2)
    step_s, ckpt_s = g_healthy["step_s"], g_every1["checkpoint_s"]
    n_young = max(1, round(math.sqrt(2 * ckpt_s * args.period) / step_s))
    sweep = [n_young] if args.quick else sorted({max(1, n_young // 4), n_young, 4 * n_young})
    g_faults_all = {n: run_gpipe(args, out, f"faults_every{n}", n, fault_s, args.period) for n in sweep}
    g_faults = max(g_faults_all.values(), key=lambda r: r["throughput"])
    print(
        f"GPipe: {g_healthy['throughput']:.0f} samples/s healthy, {g_faults['throughput']:.0f} with faults "
        f"(checkpoint every {g_faults['every']} steps, restart {g_faults['restart_s']} s)",
        flush=True,
    )

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    hetero: dict = {}
    try:
        s = run_swarm(args, dht)
        print(
            f"swarm: {s['healthy']:.1f} -> {s['faults']:.1f} samples/s with faults "
            f"({s['kills']} kills, down {s['down_fraction']:.0%})",
            flush=True,
        )
        if os.access(CGROUP_ROOT, os.W_OK):
            with SlowCgroup() as slow:
                g_het = run_gpipe(args, out, "hetero", g_faults["every"], args.phase, slow=slow)
                # the same without checkpoints: what GPipe makes where no kill is expected
                g_het_plain = run_gpipe(args, out, "hetero_no_checkpoints", 10**9, args.phase, slow=slow)
                # what a user of GPipe would run instead: the fast processes alone (the slow machine left out)
                g_fast = run_gpipe(args, out, "hetero_fast_only", 10**9, args.phase)
                g_throttle = slow.stats()
                s_het = run_swarm_hetero(args, dht, slow)
                s_throttle = {k: v - g_throttle.get(k, 0) for k, v in slow.stats().items()}
            hetero = {
                "throughput_hetero_swarm": _r(s_het["throughput"]),
                "throughput_hetero_gpipe": _r(g_het["throughput"]),
                "speedup_vs_gpipe_hetero": _r(s_het["throughput"] / g_het["throughput"], 3),
                "throughput_hetero_gpipe_no_checkpoints": _r(g_het_plain["throughput"]),
                "speedup_vs_gpipe_hetero_no_checkpoints": _r(
                    s_het["throughput"] / g_het_plain["throughput"], 3
                ),
                "throughput_hetero_gpipe_fast_only": _r(g_fast["throughput"]),
                "speedup_vs_gpipe_hetero_fast_only": _r(s_het["throughput"] / g_fast["throughput"], 3),
                "gpipe_hetero_vs_healthy": _r(g_het["throughput"] / g_healthy["throughput"], 3),
                "hetero_swarm_layout": "stage 0: 1 peer; stage 1: 1 slow + 1 normal peer",
                "hetero_failed_microbatches": s_het["errors"],
                "hetero_swarm_stage1_believed_samples_per_s": s_het["routed"],
                "slow_cgroup_throttled": {"gpipe_rank1": g_throttle, "swarm_peer": s_throttle},
            }
            print(
                f"hetero: swarm {s_het['throughput']:.1f}, GPipe {g_het['throughput']:.1f} samples/s "
                f"({g_het_plain['throughput']:.1f} without checkpoints, {g_fast['throughput']:.1f} on the fast "
                "processes alone)",
                flush=True,
            )
        else:
            hetero = {"hetero_skipped": f"{CGROUP_ROOT} is not writable (needs root and cgroup v1)"}
    finally:
        dht.shutdown()

    summary = {
        "throughput_faults_swarm": _r(s["faults"]),
        "throughput_faults_gpipe": _r(g_faults["throughput"]),
        "speedup_vs_gpipe_faults": _r(s["faults"] / g_faults["throughput"], 3),
        **{k: v for k, v in hetero.items() if k.startswith(("throughput", "speedup"))},
        "throughput_healthy_swarm": _r(s["healthy"]),
        "throughput_healthy_gpipe": _r(g_healthy["throughput"]),
        "throughput_healthy_gpipe_every1": _r(g_every1["throughput"]),
        "speedup_vs_gpipe_healthy": _r(s["healthy"] / g_healthy["throughput"], 3),
        "throughput_faults_swarm_completed": _r(s["faults_completed"]),
        "swarm_counts": "committed steps" if args.swarm_steps == "trainer" else "completed less 256 per kill",
        "retained": _r(s["faults"] / max(s["healthy"], 1e-9), 3),
        "retained_gpipe": _r(g_faults["throughput"] / g_healthy["throughput"], 3),
        "gpipe_checkpoint_every_steps": g_faults["every"],
        "gpipe_checkpoint_s": _r(ckpt_s, 5),
        "gpipe_step_s": _r(step_s, 4),
        "gpipe_young_n": n_young,
        "gpipe_sweep": {str(n): _r(r["throughput"]) for n, r in g_faults_all.items()},
        "gpipe_restart_s": [round(x, 2) for x in g_faults["restart_s"]],
        "gpipe_recovery_s": [round(x, 2) for x in g_faults["recovery_s"]],
        "gpipe_samples_per_step": g_faults["samples_per_step"],
        "kills": s["kills"],
        "kills_gpipe": g_faults["kills"],
        "kill_period_s": args.period,
        "fault_phase_s": fault_s,
        **{k: v for k, v in hetero.items() if not k.startswith(("throughput", "speedup"))},
        # the swarm's figures under their earlier names (benchmarks/_harness/registry.py)
        "throughput_no_faults": _r(s["healthy"]),
        "throughput_with_faults": _r(s["faults"]),
        "down_fraction": _r(s["down_fraction"], 3),
        "downtime_s": s["downtime_s"],
        "retries": s["retries"],
        "failed_microbatches": s["failed_microbatches"],
        "concurrency": args.concurrency,
        "microbatch": BATCH,
        "width": WIDTH,
        "blocks": BLOCKS,
        "swarm_steps": args.swarm_steps,
        "swarm_optimizer_steps": s["steps"],
        "swarm_failed_steps": s["step_errors"],
        "quick": args.quick,
        "plot": str(report.png),
    }
    plot(s, g_faults, summary, report.png)
    report.finish(summary)


if __name__ == "__main__":
    main()
