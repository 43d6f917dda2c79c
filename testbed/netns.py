"""A private network for benchmark processes: one network namespace per rank, joined by veth pairs through a
bridge that lives in a namespace of its own, every link shaped by ``tc`` (rate limit, optional delay).

Nothing touches the root namespace's routes: the bridge and all addresses (10.213.<net>.<rank+1>/24) exist
only inside namespaces this module creates, named ``lsw-<pid>-<suffix>``. They are deleted on ``close()``, at
interpreter exit and on SIGINT/SIGTERM (deleting a namespace deletes its veth ends).

Needs root (``ip netns``, ``tc``). Used by the benchmarks (through ``benchmarks/_harness/links.py``, which puts
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
import signal
import subprocess
from collections.abc import Sequence
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
        net: the third octet of the private subnet 10.213.<net>.0/24.
    """

    def __init__(
        self, num_ranks: int, rate_mbit: float | None = 1000, delay_ms: float = 0.0, net: int = 0
    ) -> None:
        if os.geteuid() != 0:
            raise PermissionError(
                "VirtualCluster needs root to create network namespaces (`ip netns`) and shape links (`tc`). "
                "Run the benchmark as root, or pass --no-netns to run on loopback without link limits."
            )
        if not 1 <= num_ranks <= 200:
            raise ValueError(f"num_ranks must be in 1..200, got {num_ranks}.")
        self.num_ranks = num_ranks
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.prefix = f"lsw-{os.getpid()}-{net}"
        self.bridge_ns = f"{self.prefix}-br"
        self.subnet = f"10.213.{net}"
        self.ifname = "eth0"
        self._created: list[str] = []
        self._closed = False

    def rank_ns(self, rank: int) -> str:
        return f"{self.prefix}-{rank}"

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

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
                # Create the pair inside the bridge namespace, then move one end: the root namespace never
                # holds either end.
                _run("ip", "-n", self.bridge_ns, "link", "add", outer, "type", "veth", "peer", "name", "tmp0")
                _run("ip", "-n", self.bridge_ns, "link", "set", "tmp0", "netns", ns)
                _run("ip", "-n", ns, "link", "set", "tmp0", "name", self.ifname)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", self.ifname)
                _run("ip", "-n", ns, "link", "set", self.ifname, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", self.bridge_ns, "link", "set", outer, "master", "br0")
                _run("ip", "-n", self.bridge_ns, "link", "set", outer, "up")
                self._shape(ns, self.ifname)
                self._shape(self.bridge_ns, outer)
        except BaseException:
            self.close()
            raise

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
        for name in reversed(self._created):
            _run("ip", "netns", "del", name, check=False)
        self._created.clear()
        if self in _LIVE:
            _LIVE.remove(self)

    def popen(
        self, rank: int, cmd: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` inside rank ``rank``'s namespace (gloo is pinned to its veth)."""
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.ifname}
        return subprocess.Popen(["ip", "netns", "exec", self.rank_ns(rank), *cmd], env=full_env, **kwargs)

    def tx_bytes(self, rank: int) -> int:
        """Bytes rank ``rank`` has sent on its link so far."""
        out = _run("ip", "-n", self.rank_ns(rank), "-s", "-j", "link", "show", "dev", self.ifname).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def leftover_namespaces() -> list[str]:
    """Namespaces of this process that still exist (for tests of the cleanup)."""
    out = _run("ip", "netns", "list", check=False).stdout
    mine = f"lsw-{os.getpid()}-"
    return [line.split()[0] for line in out.splitlines() if line.startswith(mine)]
