"""testbed/nfqueue_delay.py: a real iptables NFQUEUE rule in a real network namespace, and the holder program
delaying real TCP packets (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_holder_delays_every_packet_at_least_its_delay_and_cleans_up() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and iptables need root")
    delay_ms = 0.2
    cmd = [
        sys.executable,
        str(REPO / "testbed" / "nfqueue_delay.py"),
        "--measure",
        "--delay-ms",
        str(delay_ms),
    ]
    proc = subprocess.run([*cmd, "--round-trips", "300"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # a round trip is two packets, each held at least the delay: a lower bound whatever the load
    assert result["holder_delayed"]["median_us"] >= 2 * delay_ms * 1000, result
    assert result["no_rule"]["median_us"] < 2 * delay_ms * 1000, result
    assert result["holder_delayed"]["holder_cpu_us_per_packet"] > 0, result
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(name.endswith("-lat") for name in listed.split()), listed


_ECHO = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5000))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while data := c.recv(64):
        c.sendall(data)
"""
_PING = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5000), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(15):
    start = time.monotonic()
    s.sendall(b"x" * 64)
    s.recv(64)
    times.append((time.monotonic() - start) * 1000)
print(sorted(times)[len(times) // 2])
"""


@pytest.mark.timeout(120)
def test_a_test_bed_with_egress_delay_gives_every_round_trip_twice_the_delay_nat_included() -> None:
    """``VirtualCluster(egress_delay_ms=D)``: the holder of every host's namespace delays its outgoing packets, so a
    round trip between two hosts, public or behind NAT, takes at least 2 D; the holders end with the cluster."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces and iptables need root")
    sys.path.insert(0, str(REPO))
    from testbed import netns

    delay_ms = 10.0
    with netns.VirtualCluster(
        3, rate_mbit=100, net=253, nat_ranks=[2], internet=True, egress_delay_ms=delay_ms
    ) as net:
        server = net.popen(0, [sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        medians = {}
        for rank in (1, 2):  # public, behind NAT
            out = net.run(rank, [sys.executable, "-c", _PING, net.address(0)], timeout=60)
            assert out.returncode == 0, out.stderr[-2000:]
            medians[rank] = float(out.stdout.strip())
        holders = [p for p, _ in net._procs if "nfqueue_delay.py" in " ".join(map(str, p.args))]
        assert len(holders) == 3
    assert all(2 * delay_ms <= m < 2 * delay_ms + 40.0 for m in medians.values()), medians
    assert all(p.poll() is not None for p in holders)
    assert not [n for n in netns.leftover_namespaces() if n.startswith(f"lsw-{os.getpid()}-253")]
