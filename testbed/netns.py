"""A private network for benchmark processes: one network namespace per rank, joined by veth pairs through a
bridge that lives in a namespace of its own, every link shaped by ``tc`` (rate limit, optional delay).

Some ranks can sit behind NAT (``nat_ranks``), as a volunteer's machine behind a home router: such a rank's host
namespace has a private address (192.168.<rank+1>.2) and reaches the bridge through a router namespace of its own
whose ``iptables`` MASQUERADE rewrites its connections to the router's address on the bridge
(10.213.<net>.<rank+1>, the rank's ``public_address``). Nothing on the bridge can open a connection to the rank;
the rank can open connections out, and their answers come back (connection tracking).

Nothing touches the root namespace's routes: the bridge and all addresses (10.213.<net>.<rank+1>/24, or with
``internet=True`` 192.0.0.<rank+129>/25, which libp2p counts as public) exist
only inside namespaces this module creates, named ``lsw-<pid>-<suffix>``. They are deleted on ``close()``, at
interpreter exit and on SIGINT/SIGTERM (deleting a namespace deletes its veth ends); processes started with
:meth:`VirtualCluster.popen` are killed (their process group) before that.

Needs root (``ip netns``, ``tc``; ``iptables`` for NAT: ``scripts/setup.sh`` installs it). Used by the benchmarks (through ``benchmarks/_harness/links.py``, which puts
loopback behind the same interface) and by ``tests/test_dslide.py``. Usage::

    with VirtualCluster(num_ranks=2, rate_mbit=1000) as net:
        procs = [net.popen(rank, [sys.executable, "worker.py"], env={...}) for rank in range(2)]
        ...
        net.tx_bytes(0)  # bytes sent by rank 0 so far
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

_LIVE: list[VirtualCluster] = []
_HANDLERS_INSTALLED = False


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _cleanup_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _cleanup_all()
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_cleanup_all)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)


class VirtualCluster:
    """``num_ranks`` network namespaces on one bridge, every veth shaped to ``rate_mbit`` (None: unlimited).

    Args:
        num_ranks: how many rank namespaces to create.
        rate_mbit: link rate in Mbit/s applied in both directions of every rank's link; ``None`` for no limit.
        delay_ms: one-way delay added on every link (netem); 0 for none.
        egress_delay_ms: one-way delay added to every packet a rank sends (not its router's), by an
            ``iptables -j NFQUEUE`` rule in the rank's namespace and ``testbed/nfqueue_delay.py`` holding each packet
            there (this kernel has no netem): between two ranks a round trip takes twice this, through a relay
            four times. 0 for none.
        net: the third octet of the private subnet 10.213.<net>.0/24.
        internet: give the bridge's hosts addresses that libp2p counts as public (192.0.0.129-254/25, an IANA
            special-purpose block that is never routed: no real host has one) instead of 10.213.<net>.0/24, which
            go-libp2p treats as a LAN (AutoNAT never probes it, relays keep their 128 KiB default limit, circuit
            addresses are not announced). The block exists only on this cluster's bridge: no namespace of it has a
            route out, so nothing sent to it leaves the test bed.
        nat_ranks: ranks behind NAT, each behind a router namespace of its own (see the module docstring); their
            access link (host to router) is the shaped one.
    """

    def __init__(
        self,
        num_ranks: int,
        rate_mbit: float | None = 1000,
        delay_ms: float = 0.0,
        net: int = 0,
        egress_delay_ms: float = 0.0,
        nat_ranks: Sequence[int] = (),
        internet: bool = False,
    ) -> None:
        if os.geteuid() != 0:
            raise PermissionError(
                "VirtualCluster needs root to create network namespaces (`ip netns`) and shape links (`tc`). "
                "Run the benchmark as root, or pass --no-netns to run on loopback without link limits."
            )
        if not 1 <= num_ranks <= 200:
            raise ValueError(f"num_ranks must be in 1..200, got {num_ranks}.")
        self.num_ranks = num_ranks
        self.nat_ranks = frozenset(nat_ranks)
        if not self.nat_ranks <= set(range(num_ranks)):
            raise ValueError(f"nat_ranks {sorted(self.nat_ranks)} must be ranks in [0, {num_ranks}).")
        if self.nat_ranks and shutil.which("iptables") is None:
            raise RuntimeError(
                "VirtualCluster(nat_ranks=...) needs the iptables command for NAT: `apt-get install -y iptables` "
                "(scripts/setup.sh installs it)."
            )
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.egress_delay_ms = egress_delay_ms
        if egress_delay_ms and shutil.which("iptables") is None:
            raise RuntimeError(
                "VirtualCluster(egress_delay_ms=...) needs the iptables command for its NFQUEUE rule: "
                "`apt-get install -y iptables` (scripts/setup.sh installs it)."
            )
        self.prefix = f"lsw-{os.getpid()}-{net}"
        self.bridge_ns = f"{self.prefix}-br"
        if internet and num_ranks > 126:
            raise ValueError(f"VirtualCluster(internet=True) holds at most 126 ranks, got {num_ranks}.")
        self.subnet, self._host0, self._prefix = (
            ("192.0.0", 129, 25) if internet else (f"10.213.{net}", 1, 24)
        )
        self.ifname = "eth0"
        self._created: list[str] = []
        self._procs: list[tuple[subprocess.Popen[bytes], bool]] = []  # (process, leads its own group)
        self._closed = False

    def rank_ns(self, rank: int) -> str:
        return f"{self.prefix}-{rank}"

    def router_ns(self, rank: int) -> str:
        """The namespace of the NAT router in front of rank ``rank`` (a rank in ``nat_ranks``)."""
        return f"{self.prefix}-{rank}-nat"

    def address(self, rank: int) -> str:
        """The address rank ``rank`` has on its own interface (a private one behind NAT)."""
        if rank in self.nat_ranks:
            return f"192.168.{rank + 1}.2"
        return f"{self.subnet}.{rank + self._host0}"

    def public_address(self, rank: int) -> str:
        """The address the other ranks see rank ``rank``'s connections come from (its router's, behind NAT)."""
        return f"{self.subnet}.{rank + self._host0}"

    def __enter__(self) -> VirtualCluster:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> None:
        _install_handlers()
        _LIVE.append(self)
        try:
            self._add_ns(self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for rank in range(self.num_ranks):
                ns = self.rank_ns(rank)
                self._add_ns(ns)
                outer = f"v{rank}"
                if rank in self.nat_ranks:
                    router = self.router_ns(rank)
                    self._add_ns(router)
                    self._veth(
                        self.bridge_ns, outer, router, "wan", f"{self.public_address(rank)}/{self._prefix}"
                    )
                    self._veth(router, "lan", ns, self.ifname, f"{self.address(rank)}/24")
                    _run("ip", "-n", router, "addr", "add", f"192.168.{rank + 1}.1/24", "dev", "lan")
                    _run("ip", "-n", router, "link", "set", "lan", "up")
                    _run("ip", "-n", ns, "route", "add", "default", "via", f"192.168.{rank + 1}.1")
                    self._masquerade(router)
                    self._shape(ns, self.ifname)
                    self._shape(router, "lan")
                else:
                    self._veth(self.bridge_ns, outer, ns, self.ifname, f"{self.address(rank)}/{self._prefix}")
                    self._shape(ns, self.ifname)
                    self._shape(self.bridge_ns, outer)
                _run("ip", "-n", self.bridge_ns, "link", "set", outer, "master", "br0")
                _run("ip", "-n", self.bridge_ns, "link", "set", outer, "up")
            if self.egress_delay_ms:
                self._delay_egress()
        except BaseException:
            self.close()
            raise

    def _delay_egress(self) -> None:
        """Every rank's outgoing packets wait ``egress_delay_ms`` in a packet holder of its namespace (see
        ``testbed/nfqueue_delay.py``), which dies with the cluster."""
        holder = str(Path(__file__).with_name("nfqueue_delay.py"))
        for rank in range(self.num_ranks):
            self.popen(
                rank, [sys.executable, holder, "--queue", "0", "--delay-ms", str(self.egress_delay_ms)]
            )
        # the holders bind their queue (until then, --queue-bypass lets packets pass undelayed)
        time.sleep(1.0)
        for rank in range(self.num_ranks):
            rule = ["-o", self.ifname, "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
            _run("ip", "netns", "exec", self.rank_ns(rank), "iptables", "-A", "OUTPUT", *rule)

    @staticmethod
    def _veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str, addr_b: str) -> None:
        """A veth pair ``dev_a`` (in ``ns_a``) -- ``dev_b`` (in ``ns_b``, address ``addr_b``, up with its lo)."""
        # Create the pair inside ns_a, then move one end: the root namespace never holds either end.
        _run("ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", "tmp0")
        _run("ip", "-n", ns_a, "link", "set", "tmp0", "netns", ns_b)
        _run("ip", "-n", ns_b, "link", "set", "tmp0", "name", dev_b)
        _run("ip", "-n", ns_b, "addr", "add", addr_b, "dev", dev_b)
        _run("ip", "-n", ns_b, "link", "set", dev_b, "up")
        _run("ip", "-n", ns_b, "link", "set", "lo", "up")

    @staticmethod
    def _masquerade(router: str) -> None:
        """``router`` forwards its LAN's connections out of ``wan`` under its own address, and lets in only their
        answers (a home router without port forwarding)."""
        _run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        ipt = ["ip", "netns", "exec", router, "iptables"]
        _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        _run(*ipt, "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")
        _run(*ipt, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        _run(*ipt, "-P", "FORWARD", "DROP")

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit is not None:
            # Token bucket: `rate` is the link rate; the bucket holds ~1 ms of traffic at that rate (at least
            # 64 KiB so the kernel's timer granularity does not cap the rate), the queue up to 200 ms.
            burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))
            tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        if self.delay_ms:
            parent = ["parent", "1:1"] if self.rate_mbit is not None else ["root"]
            netem = ["netem", "delay", f"{self.delay_ms}ms"]
            proc = _run("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, *netem, check=False)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"Cannot add a {self.delay_ms} ms delay: the kernel has no netem qdisc ({proc.stderr.strip()}). "
                    "Load the sch_netem module on the host, or run without a delay."
                )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc, leads_group in self._procs:  # a process in a deleted namespace would live on, unreachable
            kill_group(proc, leads_group)
        self._procs.clear()
        for name in reversed(self._created):
            _run("ip", "netns", "del", name, check=False)
        self._created.clear()
        if self in _LIVE:
            _LIVE.remove(self)

    def popen(
        self, rank: int, cmd: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` inside rank ``rank``'s namespace (gloo is pinned to its veth). Unless ``kwargs`` choose
        otherwise (``preexec_fn``/``start_new_session``), it leads a process group of its own, killed on
        :meth:`close`."""
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.ifname}
        if "preexec_fn" not in kwargs:
            kwargs.setdefault("start_new_session", True)
        leads_group = "preexec_fn" in kwargs or bool(kwargs.get("start_new_session"))
        proc = subprocess.Popen(["ip", "netns", "exec", self.rank_ns(rank), *cmd], env=full_env, **kwargs)
        self._procs.append((proc, leads_group))
        return proc

    def run(
        self, rank: int, cmd: Sequence[str], timeout: float = 30.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in rank ``rank``'s namespace to its end, output captured; after ``timeout`` s its process
        group is killed and ``subprocess.TimeoutExpired`` raised."""
        proc = self.popen(rank, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            kill_group(proc)  # its helpers too (a DHT, a p2p daemon), whatever happened
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def tx_bytes(self, rank: int) -> int:
        """Bytes rank ``rank`` has sent on its link so far."""
        out = _run("ip", "-n", self.rank_ns(rank), "-s", "-j", "link", "show", "dev", self.ifname).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def kill_group(proc: subprocess.Popen[Any], leads_group: bool = True) -> None:
    """SIGKILL the process group ``proc`` leads (its helpers too, even once ``proc`` itself has exited; ``proc``
    alone if ``leads_group`` is False) and reap ``proc``."""
    try:
        if leads_group:
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def leftover_namespaces() -> list[str]:
    """Namespaces of this process that still exist (for tests of the cleanup)."""
    out = _run("ip", "netns", "list", check=False).stdout
    mine = f"lsw-{os.getpid()}-"
    return [line.split()[0] for line in out.splitlines() if line.startswith(mine)]
