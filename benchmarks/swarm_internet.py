"""A swarm of volunteers on an internet-like test bed: peers in network namespaces on 100 Mbit/s links, two of
them behind NAT, served through relays, then churn.

Layout (``testbed.netns.VirtualCluster(internet=True)``, 9 hosts, 50 ms of round trip between two hosts:
``--rtt-ms``): ranks 0-3 public stage servers (2 per stage; rank 0 is the initial peer, and so the relay),
ranks 4-5 stage servers behind NAT (one per stage, each behind a router with iptables MASQUERADE), rank 6 a
trainer behind NAT, ranks 7-8 public trainers. Every peer runs ``testbed/internet_peer.py`` with the default
``reachability="auto"``; the model is the small MLP of ``testbed/stage_peer.py`` (``--width``, ``--blocks`` per
stage), 8-bit boundaries. Stage optimizers do not step (``target_batch_size`` above the run's
samples): this measures reachability and routing, not averaging.

Phases: healthy (both trainers train for ``phase`` s), then churn (a public stage server, never rank 0, SIGKILLed
every ``kill_every`` s with its process group, a new one started in its namespace ``rejoin_after`` s later, by
``testbed.churn.Churn``). Figures:

- ``nat_peers_serving``: NAT'd servers that served calls (of ``nat_servers``);
- ``relay_share_of_calls``: calls whose connection went through a relay, over all stage calls;
- ``throughput_relayed_vs_direct``: for the same NAT'd server, samples per busy second (the trainer's view: network,
  queue and compute) of its calls through the relay (from the NAT'd trainer) over that of its direct calls (from
  the public trainers, over the connections its own DHT node opened to them), averaged over the NAT'd servers;
- ``retained``: trainers' samples/s under churn over healthy (target >= 0.75); ``samples_lost``: samples of steps
  that failed (target 0); ``hangs``: steps longer than ``4 x request_timeout`` or trainers that did not report
  (target 0);
- full run only: ``serving_pss_growth_mb_per_hour``, the memory growth of the NAT'd stage-0 server (PSS of its
  process and helpers, sampled every 10 s, the slope of a least-squares line after the first quarter of the run;
  its optimizer does not step). The memory target of a 4-peer stage that averages, over 30 minutes, is
  ``--averaging``'s.

``--averaging`` runs averaging at scale instead (report ``swarm_internet_averaging``; the issue's measure of a
4-peer stage's memory over a 30-minute run is its ``rss_growth_mb_per_hour``). 10 hosts on the same test bed: ranks
0-3 serve stage 0 and ranks 4-7 stage 1 (ranks 3 and 7 behind NAT, reached through the relay; ``--no-nat``: all
public), ranks 8-9 are public trainers. With ``--stage-steps sync`` (the default: the strategy's synchronous
mode) rank 8 alone trains and commands every stage's step after each of its own steps, and the stage's peers sum
that step's gradients in one all-reduce round among all of them (the peers the trainer names); with ``async``
the stage optimizers step whenever the trainers have sent ``--steps-per-round`` steps' worth of samples (hivemind's
collaborative ``Optimizer``, whose peers that fall behind download the state instead of averaging). Every round
goes through the peers' p2p daemons over the shaped links (``same_host`` off; each peer has a namespace of its
own, which the same-host paths never cross). Every ``--sample-s`` seconds the benchmark reads
each server's memory: the PSS of its process and its helpers (DHT process, p2p daemon, averagers). Figures:

- ``rss_growth_mb_per_hour``: the largest slope over the servers of a least-squares line through its samples after
  the first quarter of the run (target <= 50); ``pss_mb_after_warmup_and_at_end`` per server;
- ``rounds_per_step``: per stage, the least over its peers of the averaging rounds (with other peers) a peer took
  part in over the stage's optimizer steps, the least over the stages (target about 1: every step averaged);
  ``mean_group_size``: per stage, the mean size of those rounds' groups (4: every peer in every round);
- ``peers_per_stage``, ``stage_steps``, ``trainer_steps``, ``servers`` (stage, behind NAT or not, how reached);
- ``meets_target``: the growth target met, no failed trainer step, no hang, no ERROR or traceback in the peers'
  logs; ``every_peer_every_step``: ``rounds_per_step`` >= 0.95 and ``mean_group_size`` >= 3.9 in every stage.

``--minutes`` sets the trainers' time (default 30; ``--quick``: 4).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
from _harness.memory import GROWTH_TARGET_MB_PER_HOUR, growth_in_window, tree_pss_mb

from testbed.churn import Churn
from testbed.netns import VirtualCluster

JOB = _harness.ROOT / "testbed" / "internet_peer.py"
PUBLIC_SERVERS = {0: 0, 1: 0, 2: 1, 3: 1}  # rank: stage
NAT_SERVERS = {4: 0, 5: 1}
NAT_TRAINER = 6
TRAINERS = (6, 7, 8)
HOSTS = 9
# --averaging: 2 stages x 4 servers (one per stage behind NAT unless --no-nat), then 2 public trainers
AVG_SERVERS = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}  # rank: stage
AVG_NAT_SERVERS = (3, 7)
AVG_TRAINERS = (8, 9)
AVG_HOSTS = 10


def _sample_until(until: float, pid: int, samples: list[tuple[float, float]], every_s: float = 10.0) -> None:
    """Until ``until`` (wall time), append ``(time, MB)``, the PSS of ``pid`` and its helpers, every ``every_s``."""
    while time.time() < until:
        mb = tree_pss_mb(pid)
        if mb > 0:
            samples.append((time.time(), mb))
        time.sleep(max(0.0, min(every_s, until - time.time())))


class Swarm:
    """The peers of the run on ``net``; every process dies with the benchmark (``VirtualCluster.close``)."""

    def __init__(self, net: VirtualCluster, base: dict[str, Any], log_dir: Path) -> None:
        self.net, self.base, self.log_dir = net, base, log_dir
        self.initial: list[str] = []
        self.infos: dict[int, dict[str, Any]] = {}

    def listen(self, rank: int) -> str:
        return self.net.address(rank) if rank not in self.net.nat_ranks else "0.0.0.0"

    def spawn(self, rank: int, cfg: dict[str, Any]) -> subprocess.Popen:
        """Start ``testbed/internet_peer.py`` with ``cfg`` on ``rank`` (stdin and stdout piped, stderr to its log)."""
        return self.net.popen(
            rank,
            [sys.executable, str(JOB), json.dumps(cfg)],
            env={"PYTHONPATH": str(_harness.ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_dir / f"rank{rank}.log", "a"),
            text=True,
        )

    def spawn_server(self, rank: int, stage: int) -> subprocess.Popen:
        """Start a stage server on ``rank`` (see :meth:`ready`)."""
        cfg = {**self.base, "role": "server", "stage": stage, "initial_peers": self.initial}
        cfg["listen"] = self.listen(rank)
        if rank == 0:
            cfg["port"] = 31337
        return self.spawn(rank, cfg)

    def ready(self, rank: int, proc: subprocess.Popen) -> subprocess.Popen:
        """Wait for the server on ``rank`` to serve (its first line: peer id, addresses, how it is reached)."""
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the stage server on rank {rank} exited; see {self.log_dir}/rank{rank}.log")
        self.infos[rank] = json.loads(line)
        return proc

    def start_server(self, rank: int, stage: int) -> subprocess.Popen:
        return self.ready(rank, self.spawn_server(rank, stage))

    def start_servers(self, stages: dict[int, int]) -> dict[int, subprocess.Popen]:
        """Start a stage server on each rank of ``stages`` (rank: stage; rank 0 first: the initial peer, whose
        address on the bridge every other peer starts from) and wait until all serve."""
        procs = {0: self.start_server(0, stages[0])}
        self.initial = [a for a in self.infos[0]["maddrs"] if f"/ip4/{self.net.address(0)}/" in a]
        spawned = {r: self.spawn_server(r, k) for r, k in stages.items() if r != 0}
        procs.update({r: self.ready(r, proc) for r, proc in spawned.items()})
        return procs

    def start_trainers(self, ranks: tuple[int, ...], batch: int, **extra: Any) -> dict[int, subprocess.Popen]:
        """Start a trainer on each of ``ranks`` (batches of ``batch`` rows; ``extra``: more of its config) and wait
        until every one can train (each has its DHT and client: all start at once); :meth:`go` starts them."""
        trainers = {}
        for rank in ranks:
            cfg = {**self.base, "role": "trainer", "initial_peers": self.initial, "listen": self.listen(rank)}
            cfg.update(batch=batch, wait_go=True, seed=rank, step_id_base=rank * 10**9, **extra)
            trainers[rank] = self.spawn(rank, cfg)
        for rank, proc in trainers.items():
            if not proc.stdout.readline():
                raise RuntimeError(f"the trainer on rank {rank} exited; see {self.log_dir}/rank{rank}.log")
        return trainers

    @staticmethod
    def go(trainers: dict[int, subprocess.Popen], begin: float, until: float) -> None:
        for proc in trainers.values():
            proc.stdin.write(f"{begin} {until}\n")
            proc.stdin.flush()

    @staticmethod
    def results(trainers: dict[int, subprocess.Popen], timeout: float) -> tuple[dict[int, dict], int]:
        """Each trainer's report (its last stdout line), by rank, and how many did not report within ``timeout``
        seconds."""
        results, hangs = {}, 0
        for rank, proc in trainers.items():
            try:
                out, _ = proc.communicate(timeout=timeout)
                results[rank] = json.loads(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                hangs += 1  # a trainer that did not finish (or report) in time
        return results, hangs


def served_info(proc: subprocess.Popen, timeout: float) -> dict[str, Any] | None:
    """The ``info()`` a stage server whose stdin was closed prints before it shuts down (``None``: none came within
    ``timeout`` seconds; the server's process group is then killed)."""
    proc.stdin = None  # closed by the caller (every server at once): communicate leaves it alone
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _harness.kill_group(proc)
        out, _ = proc.communicate()  # what it printed before (communicate keeps it across a timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"served"')]
    return lines[-1]["served"] if lines else None


def averaging(args: Any) -> None:
    """The ``--averaging`` run (see the module docstring): report ``swarm_internet_averaging``."""
    report = _harness.Report("swarm_internet_averaging", args.out)
    log_dir = Path(tempfile.mkdtemp(prefix="swarm_internet_averaging-"))
    print(f"peer logs: {log_dir}", flush=True)
    minutes = args.minutes or (4.0 if args.quick else 30.0)
    nat = () if args.no_nat else AVG_NAT_SERVERS
    base = {
        "num_stages": 2,
        "run_id": "internet_averaging",
        "width": args.width,
        "blocks": args.blocks,
        "compression": "8bit",
        "target_batch_size": len(AVG_TRAINERS) * args.batch * args.steps_per_round,
        "request_timeout": 15.0,
        "ban_base_s": 5.0,
        "no_peers_timeout": 60.0,
        "matchmaking_time": args.matchmaking_s,  # how long a stage's peers gather for a round: all 4 should make it
        "averaging_timeout": 30.0,
        "same_host": False,  # every peer has a namespace of its own anyway: no same-host path between them
        "step_s": args.step_s,
        "stage_steps": "trainer" if args.stage_steps == "sync" else "async",
    }
    samples: dict[str, list[tuple[float, float]]] = {}  # rank: (wall time, MB) of the server with its helpers
    rtt = args.rtt_ms or 0.0
    with VirtualCluster(
        AVG_HOSTS, rate_mbit=args.rate_mbit, nat_ranks=nat, internet=True, egress_delay_ms=rtt / 2
    ) as net:
        swarm = Swarm(net, base, log_dir)
        servers = swarm.start_servers(AVG_SERVERS)
        # synchronous steps: one trainer, which commands every stage's step after each of its own (several would
        # need the strategy's trainer synchronisation: each stepping alone would hold some of a stage's peers in
        # a round the others are not in, and one's backwards would straddle another's steps)
        sync = args.stage_steps == "sync"
        trainers = swarm.start_trainers(
            AVG_TRAINERS[:1] if sync else AVG_TRAINERS, args.batch, command_steps=sync
        )
        begin = time.time() + 2.0
        until = begin + 60.0 * minutes
        swarm.go(trainers, begin, until)
        while time.time() < until:
            now = time.time()
            for rank, proc in servers.items():
                mb = tree_pss_mb(proc.pid)
                if mb > 0:
                    samples.setdefault(str(rank), []).append((now, mb))
            time.sleep(max(0.0, min(args.sample_s, until - time.time())))
        results, hangs = swarm.results(trainers, 120.0)
        for proc in servers.values():  # all at once: they leave together, as at the end of a run
            proc.stdin.close()
        infos = {rank: served_info(proc, 60.0) for rank, proc in servers.items()}

    # the samples while the trainers trained, after the first quarter of the run (set-up and warm-up left out)
    growth, pss, in_window = growth_in_window(samples, begin + (until - begin) / 4, until)
    worst = max(growth.values()) if len(growth) == len(servers) else None
    stages: dict[int, dict[str, Any]] = {}
    for rank, stage in AVG_SERVERS.items():
        info = infos[rank] or {}
        row = stages.setdefault(stage, {"peers": 0, "steps": [], "rounds": [], "round_peers": 0})
        row["peers"] += bool(info)
        row["steps"].append(info.get("steps", 0))
        row["rounds"].append(info.get("averaged_rounds", 0))
        row["round_peers"] += info.get("round_peers", 0)
    # a stage's steps: its peers' optimizer steps (each joins every one, or catches up after); rounds per step: the
    # least over the stage's peers of the rounds it took part in over the stage's steps
    stage_steps = [max(row["steps"]) for row in stages.values()]
    per_stage = [
        min(row["rounds"]) / max(row["steps"]) if max(row["steps"]) else 0.0 for row in stages.values()
    ]
    group = [
        row["round_peers"] / sum(row["rounds"]) if sum(row["rounds"]) else 0.0 for row in stages.values()
    ]
    rounds_per_step = min(per_stage)
    errors = [e for r in results.values() for e in r["errors"]]
    log_errors = [
        f"rank{rank}: {line.strip()}"[:300]
        for rank in range(AVG_HOSTS)
        if (log_dir / f"rank{rank}.log").exists()
        for line in (log_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
        if "ERROR" in line or "Traceback" in line
    ]
    report.finish(
        {
            "rss_growth_mb_per_hour": worst,
            "rounds_per_step": round(rounds_per_step, 3),
            "mean_group_size": [round(g, 2) for g in group],
            "peers_per_stage": min(row["peers"] for row in stages.values()),
            "stage_steps": stage_steps,
            "trainer_steps": sum(r["steps"] for r in results.values()),
            "meets_target": worst is not None
            and worst <= GROWTH_TARGET_MB_PER_HOUR
            and not (errors or log_errors or hangs),
            "every_peer_every_step": rounds_per_step >= 0.95 and min(group) >= 3.9,
            "growth_target_mb_per_hour": GROWTH_TARGET_MB_PER_HOUR,
            "rss_growth_mb_per_hour_by_rank": growth,
            "pss_mb_after_warmup_and_at_end": pss,
            "samples_in_window": min(in_window.values(), default=0),
            "rounds_per_step_by_stage": [round(r, 3) for r in per_stage],
            "rounds_by_rank": {str(r): (infos[r] or {}).get("averaged_rounds") for r in AVG_SERVERS},
            "steps_by_rank": {str(r): (infos[r] or {}).get("steps") for r in AVG_SERVERS},
            "servers": {
                str(r): {"stage": k, "nat": r in net.nat_ranks, "reached": swarm.infos[r]["reached"]}
                for r, k in AVG_SERVERS.items()
            },
            "trainers": {str(r): "public" for r in trainers},
            "trainers_reporting": len(results),
            "hangs": hangs,
            "samples_lost": sum(args.batch * len(r["errors"]) for r in results.values()),
            "errors": errors[:5],
            "log_errors": log_errors[:5],
            "run_minutes": round((until - begin) / 60.0, 1),
            "sample_s": args.sample_s,
            "target_batch_size": base["target_batch_size"],
            "trainer_steps_per_round_target": args.steps_per_round,
            "trainer_step_s": args.step_s,
            "stage_steps_mode": args.stage_steps,
            "matchmaking_s": args.matchmaking_s,
            "rate_mbit": args.rate_mbit,
            "rtt_ms": rtt,
            "latency": _latency(rtt),
            "same_host": base["same_host"],
            "model": f"testbed/stage_peer.py MLP, width {args.width}, {args.blocks} blocks per stage, 2 stages",
            "note": "10 hosts share this box's CPUs; "
            + (
                "the trainer commands each stage step, "
                if sync
                else "the stages step when their trainers have sent the target batch (hivemind's collaborative "
                "Optimizer), "
            )
            + "each step an all-reduce round of the stage's peers through their p2p daemons over the shaped "
            "links (a round redone after a partial one counts again); memory: PSS of each server with its helper "
            "processes (DHT, p2p daemon, averagers)",
        }
    )


def _latency(rtt_ms: float) -> str:
    if not rtt_ms:
        return "none added"
    return (
        f"{rtt_ms:g} ms round trip between two hosts ({rtt_ms / 2:g} ms on each host's outgoing packets, held by "
        "testbed/nfqueue_delay.py); through a relay, twice that"
    )


def main() -> None:
    parser = _harness.parser(
        "swarm_internet",
        __doc__.splitlines()[0],
        quick="a 40 s healthy phase, a 75 s churn phase with a kill every 30 s (about 5 minutes on a loaded box); "
        "with --averaging: a 4-minute run",
    )
    parser.add_argument("--width", type=int, default=256, help="hidden size of the MLP blocks")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    parser.add_argument("--batch", type=int, default=32, help="rows per trainer step")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="every host's link rate")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=None,
        help="round trip between two hosts, added by holding each host's outgoing packets RTT_MS/2 "
        "(testbed/nfqueue_delay.py; default 50; with --averaging, 0)",
    )
    avg = parser.add_argument_group(
        "--averaging", "averaging at scale instead (report swarm_internet_averaging)"
    )
    avg.add_argument(
        "--averaging", action="store_true", help="2 stages x 4 servers that step (module docstring)"
    )
    avg.add_argument("--minutes", type=float, default=None, help="the trainers' time (default 30)")
    avg.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    avg.add_argument("--steps-per-round", type=int, default=10, help="target batch, in steps of each trainer")
    avg.add_argument(
        "--step-s", type=float, default=0.5, help="a trainer begins a step at most every STEP_S s"
    )
    avg.add_argument("--matchmaking-s", type=float, default=4.0, help="the stages' matchmaking_time")
    avg.add_argument("--no-nat", action="store_true", help="every stage server public")
    avg.add_argument(
        "--stage-steps",
        choices=("sync", "async"),
        default="sync",
        help="sync (the strategy's default): each trainer commands the stages' step after each of its steps; "
        "async: the stages step when the trainers have sent --steps-per-round steps' worth of samples",
    )
    args = parser.parse_args()
    _harness.exit_on_sigterm()
    if args.averaging:
        averaging(args)
        return
    report = _harness.Report("swarm_internet", args.out)
    log_dir = Path(tempfile.mkdtemp(prefix="swarm_internet-"))  # the peers' logs (not part of the report)
    print(f"peer logs: {log_dir}", flush=True)
    phase, kill_every, rejoin_after = (40.0, 30.0, 15.0) if args.quick else (300.0, 60.0, 30.0)
    churn_s = (2 if args.quick else 5) * kill_every + rejoin_after + 5.0  # the last replacement joins too
    request_timeout = 15.0
    base = {
        "num_stages": 2,
        "width": args.width,
        "blocks": args.blocks,
        "compression": "8bit",
        "target_batch_size": 10**9,
        "request_timeout": request_timeout,
        "ban_base_s": 5.0,
        "no_peers_timeout": 60.0,
    }
    nat = [*sorted(NAT_SERVERS), NAT_TRAINER]
    rtt = 50.0 if args.rtt_ms is None else args.rtt_ms
    with VirtualCluster(
        HOSTS, rate_mbit=args.rate_mbit, nat_ranks=nat, internet=True, egress_delay_ms=rtt / 2
    ) as net:
        swarm = Swarm(net, base, log_dir)
        procs = swarm.start_servers({**PUBLIC_SERVERS, **NAT_SERVERS})
        reached = {rank: swarm.infos[rank]["reached"] for rank in procs}
        trainers = swarm.start_trainers(TRAINERS, args.batch)
        begin = time.time() + 2.0
        mid, until = begin + phase, begin + phase + churn_s
        swarm.go(trainers, begin, until)
        memory: list[tuple[float, float]] = []  # the NAT'd stage-0 server's (time, PSS MB)
        _sample_until(mid, procs[4].pid, memory)
        churned = [r for r in PUBLIC_SERVERS if r != 0]

        def restart(
            rank: int,
        ) -> subprocess.Popen:  # returns at once: the schedule does not wait for it to serve
            return swarm.spawn_server(rank, PUBLIC_SERVERS[rank])

        churn = Churn(restart, {r: procs[r] for r in churned}, kill_every, rejoin_after).begin()
        _sample_until(until, procs[4].pid, memory)
        events = churn.stop()
        results_by_rank, hangs = swarm.results(trainers, 4 * request_timeout + 60)
        results = list(results_by_rank.values())
        for proc in [*procs.values(), *churn.running().values()]:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()

    nat_ids = {swarm.infos[r]["peer_id"] for r in NAT_SERVERS}
    calls: dict[str, list[float]] = {}  # peer: [calls, busy seconds, relayed calls]
    by_way: dict[tuple[str, bool], list[float]] = {}  # (peer, relayed): [calls, busy seconds]
    for result in results:
        for peer, row in result["peers"].items():
            acc = calls.setdefault(peer, [0, 0.0, 0])
            acc[0] += row["calls"]
            acc[1] += row["busy_s"]
            acc[2] += row["calls"] if row["relayed"] else 0
            way = by_way.setdefault((peer, bool(row["relayed"])), [0, 0.0])
            way[0] += row["calls"]
            way[1] += row["busy_s"]
    batch = args.batch

    def rate(peer: str, relayed: bool) -> float | None:
        n, busy = by_way.get((peer, relayed), (0, 0.0))
        return batch * n / busy if n >= 10 and busy else None

    # the same NAT'd server, called through the relay (by the NAT'd trainer) and directly (by the public trainers,
    # which it dialled itself: its DHT node connects out to them)
    pairs = [(rate(p, True), rate(p, False)) for p in sorted(nat_ids)]
    ratios = [r / d for r, d in pairs if r is not None and d is not None]
    total_calls = sum(c[0] for c in calls.values())

    def throughput(start: float, end: float) -> float:
        done = sum(1 for r in results for t, _ in r["steps_at"] if start <= t < end)
        return batch * done / (end - start)

    healthy, churned_tp = throughput(begin, mid), throughput(mid, until)
    step_limit = 4 * request_timeout
    hangs += sum(1 for r in results for _, dt in r["steps_at"] if dt > step_limit)
    figures = {
        "nat_servers": len(NAT_SERVERS),
        "nat_hosts": len(NAT_SERVERS) + 1,
        "nat_peers_serving": sum(1 for p in nat_ids if calls.get(p, [0])[0] > 0),
        "nat_peers_relayed": sum(1 for r in NAT_SERVERS if reached[r] == "relay"),
        "relay_share_of_calls": sum(c[2] for c in calls.values()) / total_calls if total_calls else 0.0,
        "throughput_relayed_vs_direct": sum(ratios) / len(ratios) if ratios else None,
        "samples_per_busy_s_relayed_direct": [[r, d] for r, d in pairs],
        "healthy_samples_per_s": healthy,
        "churn_samples_per_s": churned_tp,
        "retained": churned_tp / healthy if healthy else 0.0,
        "samples_lost": sum(batch * len(r["errors"]) for r in results),
        "hangs": hangs,
        "kills": sum(e.kind == "kill" for e in events),
        "rejoins": sum(e.kind == "start" for e in events),
        "peers": HOSTS,
        "nat_trainer_reached": results_by_rank.get(NAT_TRAINER, {}).get("reached"),
        "reached": {str(r): v for r, v in sorted(reached.items())},
        "trainers_reporting": len(results),
        "errors": [e for r in results for e in r["errors"]][:5],
        "phase_s": phase,
        "churn_s": churn_s,
        "kill_every_s": kill_every,
        "rejoin_after_s": rejoin_after,
        "rate_mbit": args.rate_mbit,
        "model": f"testbed/stage_peer.py MLP, width {args.width}, {args.blocks} blocks per stage, 2 stages",
        "rtt_ms": rtt,
        "latency": _latency(rtt),
        "note": "all 9 hosts share this box's CPUs: a killed server frees CPU for the others, which flatters "
        "retained; stage optimizers do not step",
    }
    if not args.quick:
        growth, pss, _ = growth_in_window({"4": memory}, begin + (until - begin) / 4, until)
        figures["serving_pss_growth_mb_per_hour"] = growth.get("4")
        figures["serving_pss_mb_after_warmup_and_at_end"] = pss.get("4")
    report.finish(figures)


if __name__ == "__main__":
    main()
