"""A swarm of volunteers on an internet-like test bed: peers in network namespaces on 100 Mbit/s links, two of
them behind NAT, served through relays, then churn.

Layout (``testbed.netns.VirtualCluster(internet=True)``, 9 hosts): ranks 0-3 public stage servers (2 per stage;
rank 0 is the initial peer, and so the relay), ranks 4-5 stage servers behind NAT (one per stage, each behind a
router with iptables MASQUERADE), rank 6 a trainer behind NAT, ranks 7-8 public trainers. Every peer runs ``testbed/internet_peer.py`` with the
default ``reachability="auto"``; the model is the small MLP of ``testbed/stage_peer.py`` (``--width``,
``--blocks`` per stage), 8-bit boundaries. Stage optimizers do not step (``target_batch_size`` above the run's
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
- full run only: ``rss_growth_mb_per_hour`` of the NAT'd stage-0 server over the run.
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

from testbed.churn import Churn
from testbed.netns import VirtualCluster

JOB = _harness.ROOT / "testbed" / "internet_peer.py"
PUBLIC_SERVERS = {0: 0, 1: 0, 2: 1, 3: 1}  # rank: stage
NAT_SERVERS = {4: 0, 5: 1}
NAT_TRAINER = 6
TRAINERS = (6, 7, 8)
HOSTS = 9


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (MB)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total


class Swarm:
    """The peers of the run on ``net``; every process dies with the benchmark (``VirtualCluster.close``)."""

    def __init__(self, net: VirtualCluster, base: dict[str, Any], log_dir: Path) -> None:
        self.net, self.base, self.log_dir = net, base, log_dir
        self.initial: list[str] = []
        self.infos: dict[int, dict[str, Any]] = {}

    def spawn_server(self, rank: int, stage: int) -> subprocess.Popen:
        """Start a stage server on ``rank`` (see :meth:`ready`)."""
        cfg = {**self.base, "role": "server", "stage": stage, "initial_peers": self.initial}
        cfg["listen"] = self.net.address(rank) if rank not in self.net.nat_ranks else "0.0.0.0"
        if rank == 0:
            cfg["port"] = 31337
        return self.net.popen(
            rank,
            [sys.executable, str(JOB), json.dumps(cfg)],
            env={"PYTHONPATH": str(_harness.ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_dir / f"rank{rank}.log", "a"),
            text=True,
        )

    def ready(self, rank: int, proc: subprocess.Popen) -> subprocess.Popen:
        """Wait for the server on ``rank`` to serve (its first line: peer id, addresses, how it is reached)."""
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the stage server on rank {rank} exited; see {self.log_dir}/rank{rank}.log")
        self.infos[rank] = json.loads(line)
        return proc

    def start_server(self, rank: int, stage: int) -> subprocess.Popen:
        return self.ready(rank, self.spawn_server(rank, stage))


def main() -> None:
    parser = _harness.parser(
        "swarm_internet",
        __doc__.splitlines()[0],
        quick="a 40 s healthy phase, a 75 s churn phase with a kill every 30 s (about 5 minutes on a loaded box)",
    )
    parser.add_argument("--width", type=int, default=256, help="hidden size of the MLP blocks")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    parser.add_argument("--batch", type=int, default=32, help="rows per trainer step")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="every host's link rate")
    args = parser.parse_args()
    _harness.exit_on_sigterm()
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
    with VirtualCluster(HOSTS, rate_mbit=args.rate_mbit, nat_ranks=nat, internet=True) as net:
        swarm = Swarm(net, base, log_dir)
        procs = {0: swarm.start_server(0, 0)}
        swarm.initial = [a for a in swarm.infos[0]["maddrs"] if f"/ip4/{net.address(0)}/" in a]
        spawned = {
            r: swarm.spawn_server(r, k) for r, k in {**PUBLIC_SERVERS, **NAT_SERVERS}.items() if r != 0
        }
        procs.update({r: swarm.ready(r, proc) for r, proc in spawned.items()})
        reached = {rank: swarm.infos[rank]["reached"] for rank in procs}
        trainers = {}
        for rank in TRAINERS:
            listen = "0.0.0.0" if rank in net.nat_ranks else net.address(rank)
            cfg = {**base, "role": "trainer", "initial_peers": swarm.initial, "listen": listen}
            cfg.update(batch=args.batch, wait_go=True, seed=rank)
            trainers[rank] = net.popen(
                rank,
                [sys.executable, str(JOB), json.dumps(cfg)],
                env={"PYTHONPATH": str(_harness.ROOT)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log_dir / f"rank{rank}.log", "a"),
                text=True,
            )
        for rank, proc in trainers.items():  # every trainer has its DHT and client: all start at once
            if not proc.stdout.readline():
                raise RuntimeError(f"the trainer on rank {rank} exited; see {log_dir}/rank{rank}.log")
        begin = time.time() + 2.0
        mid, until = begin + phase, begin + phase + churn_s
        for proc in trainers.values():
            proc.stdin.write(f"{begin} {until}\n")
            proc.stdin.flush()
        rss0 = _rss_mb(procs[4].pid)
        time.sleep(max(0.0, mid - time.time()))
        churned = [r for r in PUBLIC_SERVERS if r != 0]

        def restart(
            rank: int,
        ) -> subprocess.Popen:  # returns at once: the schedule does not wait for it to serve
            return swarm.spawn_server(rank, PUBLIC_SERVERS[rank])

        churn = Churn(restart, {r: procs[r] for r in churned}, kill_every, rejoin_after).begin()
        time.sleep(max(0.0, until - time.time()))
        events = churn.stop()
        rss1 = _rss_mb(procs[4].pid)
        results, hangs, results_by_rank = [], 0, {}
        for rank, proc in trainers.items():
            try:
                out, _ = proc.communicate(timeout=4 * request_timeout + 60)
                results.append(json.loads(out.strip().splitlines()[-1]))
                results_by_rank[rank] = results[-1]
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                hangs += 1  # a trainer that did not finish (or report) in time
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
        "latency": "none added (the test bed has rate limits only)",
        "note": "all 9 hosts share this box's CPUs: a killed server frees CPU for the others, which flatters "
        "retained; stage optimizers do not step",
    }
    if not args.quick:
        hours = (until - begin) / 3600
        figures["rss_growth_mb_per_hour"] = (rss1 - rss0) / hours if hours else None
    report.finish(figures)


if __name__ == "__main__":
    main()
