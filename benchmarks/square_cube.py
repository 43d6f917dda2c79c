"""SWARM's square-cube law on this CPU: a Transformer block's compute grows like d^2 per token (d^3 for the whole
layer at fixed tokens per d), the activations it exchanges with the next stage like d; so the bigger the model, the
smaller the share of time spent on the network.

For hidden sizes d in 256..4096, this measures the forward+backward time of one pre-norm Transformer block (ALBERT's,
d/64 heads, MLP 4d) per microbatch on this CPU, next to the time to send the block's boundary traffic (its output
activations forward, their gradients back) over links of 100 Mbit/s and 1 Gbit/s, with fp32, fp16 and 8-bit
boundaries. Bytes are those the swarm's codec produces for the real tensors (``encode_tensor``); the transfer time
is measured through a rate-limited pair of network namespaces (``testbed/netns.py``, needs root) for one size
and computed from the bytes and the link rate for the rest (the measured rows say how close the computation is).

    python benchmarks/square_cube.py [--quick] [--no-netns]

Compute runs on one thread (the machine is shared; the fastest of a few runs). Last stdout line: JSON with a row
per (size, link, codec): ``compute_s``, ``comm_s`` (measured where ``measured``, else computed), ``ratio`` (compute /
communication) and ``ratio_computed`` (with the computed transfer time); ``ratio_grows_with_size`` checks the law on
``ratio_computed``, and ``measured_vs_computed`` says how the measured transfers compare (the shaped link's token
bucket lets a burst of 64 KiB through at once, so small payloads beat the computed time). The JSON and the plot
(``square_cube.png``) are written to ``runs/square_cube/`` (``--out``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import _harness

LINKS_MBIT = (100, 1000)
CODECS = ("none", "fp16", "8bit")  # "none" = fp32
PORT = 29517


def block_time(d: int, tokens: int, seq_len: int, reps: int) -> float:
    """Seconds of one block's forward + backward on a ``[tokens // seq_len, seq_len, d]`` microbatch: the fastest
    of ``reps`` runs after a warm-up (on a shared machine the minimum is the least disturbed estimate)."""
    import torch

    from examples.albert.model import AlbertBlock

    torch.manual_seed(0)
    block = AlbertBlock(d, max(1, d // 64), 4 * d, dropout=0.0)
    x = torch.randn(tokens // seq_len, seq_len, d, requires_grad=True)
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        out = block(x)
        out.backward(torch.ones_like(out))
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
        x.grad = None
    return min(times)


def boundary_bytes(d: int, tokens: int, seq_len: int, codec: str) -> int:
    """Bytes the swarm's codec puts on the wire for one microbatch's boundary: activations and their gradients."""
    import torch

    from lightning_swarm.swarm.wire.codec import encode_tensor, nbytes

    g = torch.Generator().manual_seed(d)
    shape = (tokens // seq_len, seq_len, d)
    activations = torch.randn(shape, generator=g)
    gradients = torch.randn(shape, generator=g) * 1e-3
    return nbytes([encode_tensor(activations, codec)]) + nbytes([encode_tensor(gradients, codec)])


# ---- measured transfers through shaped namespaces ----


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _worker_server(host: str) -> None:
    """Echo server: for each request ``(n, reply)`` read n bytes, answer ``reply`` bytes."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, PORT))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        header = conn.recv(16, socket.MSG_WAITALL)
        if len(header) < 16:
            return
        n, reply = struct.unpack("!QQ", header)
        if n == 0:
            return
        _recv_exact(conn, n)
        conn.sendall(b"\1" * reply)


def _worker_client(host: str, sizes: list[tuple[int, int]], reps: int) -> None:
    """Send each (forward, backward) pair ``reps`` times; print the median round trip of each as JSON."""
    conn = socket.create_connection((host, PORT), timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = []
    for fwd, bwd in sizes:
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            conn.sendall(struct.pack("!QQ", fwd, bwd) + b"\0" * fwd)
            _recv_exact(conn, bwd)
            times.append(time.perf_counter() - start)
        results.append(statistics.median(times[1:]))
    conn.sendall(struct.pack("!QQ", 0, 0))
    print(json.dumps(results), flush=True)


def measure_transfers(link_mbit: int, sizes: list[tuple[int, int]], reps: int) -> list[float]:
    with _harness.link(2, link_mbit, net=171) as net:
        me = [sys.executable, os.path.abspath(__file__)]
        server = net.popen(
            1, [*me, "--_serve", net.address(1)], stdout=subprocess.PIPE, text=True, **_harness.dies_with_me()
        )
        client = None
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo server in the namespace did not start")
            spec = json.dumps(sizes)
            client = net.popen(
                0,
                [*me, "--_client", net.address(1), spec, str(reps)],
                stdout=subprocess.PIPE,
                text=True,
                **_harness.dies_with_me(),
            )
            out, _ = client.communicate(timeout=600)
            if client.returncode != 0:
                raise RuntimeError(f"the transfer client failed ({client.returncode})")
            return json.loads(out.strip().splitlines()[-1])
        finally:
            for proc in (client, server):
                if proc is not None:
                    _harness.kill_group(proc)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {"none": "fp32", "fp16": "fp16", "8bit": "8-bit"}
    for i, link in enumerate(LINKS_MBIT):
        for j, codec in enumerate(CODECS):
            sel = [r for r in rows if r["link_mbit"] == link and r["codec"] == codec]
            style = ["-", "--", ":"][j]
            ax.plot(
                [r["hidden_size"] for r in sel],
                [r["ratio"] for r in sel],
                style,
                marker="o",
                color=f"C{i}",
                label=f"{link} Mbit/s, {names[codec]}",
            )
            measured = [r for r in sel if r["measured"]]
            ax.plot([r["hidden_size"] for r in measured], [r["ratio"] for r in measured], "k*", ms=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("hidden size d")
    ax.set_ylabel("compute time / communication time")
    ax.set_title("Square-cube law: one Transformer block per microbatch (* = measured link)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_serve":
        return _worker_server(sys.argv[2])
    if len(sys.argv) > 1 and sys.argv[1] == "--_client":
        return _worker_client(sys.argv[2], [tuple(s) for s in json.loads(sys.argv[3])], int(sys.argv[4]))
    p = _harness.parser(
        "square_cube",
        __doc__.split("\n\n")[0],
        quick="256-token microbatches (else 1024), 3 repetitions (else 5)",
    )
    p.add_argument("--sizes", default="256,512,1024,2048,4096")
    p.add_argument("--measure-size", type=int, default=4096, help="hidden size whose transfers are measured")
    p.add_argument("--no-netns", action="store_true", help="compute every transfer time (no root needed)")
    args = p.parse_args()
    report = _harness.Report("square_cube", args.out)
    import torch

    torch.set_num_threads(1)  # one core, one thread: stable timings on a shared machine
    sizes = [int(s) for s in args.sizes.split(",")]
    seq_len = 128
    tokens = 256 if args.quick else 1024
    reps = 3 if args.quick else 5
    compute = {d: block_time(d, tokens, seq_len, reps) for d in sizes}
    wire = {(d, c): boundary_bytes(d, tokens, seq_len, c) for d in sizes for c in CODECS}
    measured: dict[tuple[int, int, str], float] = {}
    netns_error = None
    if not args.no_netns and args.measure_size in sizes:
        try:
            for link in LINKS_MBIT:
                # the forward carries the activations, the reply their gradients: half of the bytes each way
                pairs = [(wire[args.measure_size, c] // 2, wire[args.measure_size, c] // 2) for c in CODECS]
                for codec, seconds in zip(CODECS, measure_transfers(link, pairs, reps=5), strict=True):
                    measured[args.measure_size, link, codec] = seconds
        except (PermissionError, RuntimeError, OSError) as e:
            netns_error = str(e)
    rows = []
    for d in sizes:
        for link in LINKS_MBIT:
            for codec in CODECS:
                computed = wire[d, codec] * 8 / (link * 1e6)
                comm = measured.get((d, link, codec), computed)
                rows.append(
                    {
                        "hidden_size": d,
                        "link_mbit": link,
                        "codec": "fp32" if codec == "none" else codec,
                        "compute_s": round(compute[d], 5),
                        "boundary_bytes": wire[d, codec],
                        "comm_s": round(comm, 5),
                        "comm_s_computed": round(computed, 5),
                        "measured": (d, link, codec) in measured,
                        "ratio": round(compute[d] / comm, 4),
                        "ratio_computed": round(compute[d] / computed, 4),
                    }
                )
    for r in rows:
        r["codec_key"] = "none" if r["codec"] == "fp32" else r["codec"]
    plot([{**r, "codec": r["codec_key"]} for r in rows], report.png)
    for r in rows:
        del r["codec_key"]
    # the law is about the link's rate: check it on the computed transfer times (the measured ones validate them)
    grows = all(
        [r["ratio_computed"] for r in rows if r["link_mbit"] == link and r["codec"] == codec]
        == sorted(r["ratio_computed"] for r in rows if r["link_mbit"] == link and r["codec"] == codec)
        for link in LINKS_MBIT
        for codec in ("fp32", "fp16", "8bit")
    )
    result = {
        "tokens_per_microbatch": tokens,
        "sizes": sizes,
        "rows": rows,
        "ratio_grows_with_size": grows,
        "ratio_growth_256_to_4096_8bit_100mbit": None,
        "measured_size": args.measure_size if measured else None,
        "measured_vs_computed": {
            f"{link}mbit_{'fp32' if c == 'none' else c}": round(
                measured[d, link, c] / (wire[d, c] * 8 / (link * 1e6)), 3
            )
            for (d, link, c) in measured
        },
        "netns_error": netns_error,
        "plot": str(report.png),
    }
    sel = [r["ratio_computed"] for r in rows if r["link_mbit"] == 100 and r["codec"] == "8bit"]
    if len(sel) >= 2:
        result["ratio_growth_256_to_4096_8bit_100mbit"] = round(sel[-1] / sel[0], 2)
    report.finish(result)


if __name__ == "__main__":
    main()
