"""Added latency without netem: a program that holds every packet an ``iptables -j NFQUEUE`` rule hands it for a
fixed time, then lets it go; and the measurement of what that costs on this machine.

This kernel has no ``netem`` qdisc, so ``tc`` can shape a link's rate but not delay it. NFQUEUE sends each
matching packet to a user-space program, which answers with a verdict; holding the verdict delays the packet. The
holder speaks netlink itself (no ``libnetfilter_queue``): it binds a queue, asks for metadata only, and accepts
the packets in arrival order once each has waited ``delay``, with one batch verdict for all that are due.

    python testbed/nfqueue_delay.py --queue 0 --delay-ms 0.1      # the holder, in the namespace of the rule
    python testbed/nfqueue_delay.py --measure [--delay-ms 0.1]    # root: the cost, as one JSON line

``--measure`` makes a namespace of its own (``lsw-<pid>-lat``, deleted at the end), queues its loopback TCP
packets, and times TCP round trips of 64 bytes (``TCP_NODELAY``) three ways: no rule, the holder with no delay
(what passing through user space costs), the holder with ``--delay-ms`` per packet (a round trip is two packets,
so the target is twice the delay plus the pass-through cost). It reports median, p90 and p99 round trips, and the
holder's CPU time per packet. Why ``benchmarks/dslide_scale.py`` does not use it: ``docs/limitations.md``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time

NETLINK_NETFILTER = 12
_QUEUE = 3 << 8  # NFNL_SUBSYS_QUEUE
_PACKET, _CONFIG, _VERDICT_BATCH = _QUEUE | 0, _QUEUE | 2, _QUEUE | 3
_REQUEST = 1
_CMD_BIND, _COPY_META, _NF_ACCEPT = 1, 1, 1
_ATTR_CMD, _ATTR_PARAMS, _ATTR_PACKET_HDR, _ATTR_VERDICT_HDR = 1, 2, 1, 2
_SPIN_S = 40e-6  # the last stretch of a wait is spun: a sleep that short overshoots by scheduling


def _message(kind: int, queue: int, attrs: list[tuple[int, bytes]]) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue)  # nfgenmsg: family, version, queue (big-endian)
    for kind_of_attr, payload in attrs:
        attr = struct.pack("=HH", 4 + len(payload), kind_of_attr) + payload
        body += attr + b"\0" * (-len(attr) % 4)
    return struct.pack("=IHHII", 16 + len(body), kind, _REQUEST, 0, 0) + body


def hold(queue: int, delay_s: float) -> None:
    """Hold every packet of NFQUEUE ``queue`` (this process's network namespace) for ``delay_s``, then accept it;
    runs until killed."""
    libc = ctypes.CDLL(None)
    libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns: wake-ups on time
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: the holder ends with the process that started it
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.send(_message(_CONFIG, queue, [(_ATTR_CMD, struct.pack("!BBH", _CMD_BIND, 0, 0))]))
    sock.send(_message(_CONFIG, queue, [(_ATTR_PARAMS, struct.pack("!IB", 0, _COPY_META))]))
    sock.setblocking(False)
    held: collections.deque[tuple[float, int]] = collections.deque()  # (due, packet id), in arrival order
    while True:
        now = time.monotonic()
        due = None
        while held and held[0][0] <= now:
            due = held.popleft()[1]
        if due is not None:  # accepts every packet up to this id
            verdict = struct.pack("!II", _NF_ACCEPT, due)
            sock.send(_message(_VERDICT_BATCH, queue, [(_ATTR_VERDICT_HDR, verdict)]))
        wait = held[0][0] - now if held else 1.0
        if wait > _SPIN_S:
            select.select([sock], [], [], wait - _SPIN_S)
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            continue
        arrived = time.monotonic()
        offset = 0
        while offset + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, offset)
            if kind == _PACKET:
                attr = offset + 20
                while attr < offset + length:
                    attr_length, attr_kind = struct.unpack_from("=HH", data, attr)
                    if attr_kind & 0x7FFF == _ATTR_PACKET_HDR:
                        held.append((arrived + delay_s, struct.unpack_from("!I", data, attr + 4)[0]))
                    attr += (attr_length + 3) & ~3
            offset += (length + 3) & ~3 if length else len(data)


def _round_trips(count: int) -> list[float]:
    """``count`` TCP round trips of 64 bytes over loopback, in microseconds, sorted."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    with socket.create_connection(server.getsockname()) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.perf_counter()
            client.sendall(b"x" * 64)
            client.recv(64)
            times.append((time.perf_counter() - start) * 1e6)
    thread.join(5)
    server.close()
    return sorted(times)


def _summary(times: list[float]) -> dict[str, float]:
    return {
        f"{name}_us": round(times[int(len(times) * q)], 1)
        for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99))
    }


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(delay_ms: float, count: int) -> dict[str, object]:
    """The cost of the holder (see the module docstring), in a namespace of its own."""
    if os.environ.get("NFQUEUE_DELAY_INSIDE") != "1":  # run again inside a namespace made for it
        ns = f"lsw-{os.getpid()}-lat"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                __file__,
                "--measure",
                "--delay-ms",
                str(delay_ms),
            ]
            out = subprocess.run(
                [*cmd, "--round-trips", str(count)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "NFQUEUE_DELAY_INSIDE": "1"},
            )
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
    result: dict[str, object] = {"delay_ms_per_packet": delay_ms, "round_trips": count}
    result["no_rule"] = _summary(_round_trips(count))
    rule = ["-o", "lo", "-p", "tcp", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
    subprocess.run(["iptables", "-A", "OUTPUT", *rule], check=True)
    for name, delay in (("holder_no_delay", 0.0), ("holder_delayed", delay_ms / 1000)):
        holder = subprocess.Popen([sys.executable, __file__, "--queue", "0", "--delay-ms", str(delay * 1000)])
        try:
            time.sleep(1.0)  # bound before the first packet (with --queue-bypass, unbound packets pass)
            before = _cpu_s(holder.pid)
            times = _round_trips(count)
            result[name] = {
                **_summary(times),
                "holder_cpu_us_per_packet": round((_cpu_s(holder.pid) - before) / (2 * count) * 1e6, 1),
            }
        finally:
            holder.kill()
            holder.wait()
    result["target_median_us"] = round(result["holder_no_delay"]["median_us"] + 2 * delay_ms * 1000, 1)  # type: ignore[index]
    result["load_average_1min"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.1, help="per packet (one way)")
    parser.add_argument(
        "--measure", action="store_true", help="root: measure the holder's cost; one JSON line"
    )
    parser.add_argument("--round-trips", type=int, default=3000)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.delay_ms, args.round_trips)))
    else:
        hold(args.queue, args.delay_ms / 1000)


if __name__ == "__main__":
    main()
