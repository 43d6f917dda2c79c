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
