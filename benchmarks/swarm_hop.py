"""One SWARM stage hop versus an echo of the same activations over the same transport, on a shaped link.

A server process (its own DHT node and p2p daemon) hosts identity stages that reply in "8bit", "fp16" and
"none", plus trivial ``ServicerBase`` echo handlers. The trainer process times, interleaved and many times
(``--order blocks``, the default: runs of 4 calls of each variant in turn, the first call of each run untimed, so
that every variant is timed in its own steady state; ``--order calls``: one call of each in turn, so that every
call follows a different variant and pays for its leftover work in the daemons, e.g. an 8-bit hop after a 1 MiB
fp32 echo):

- ``hop_<compression>``: ``SwarmClient.call_stage`` on 1 MiB of fp32 activations ([64, 4096]) under
  ``torch.no_grad()``: encode with the codec, send over the swarm's channel to the peer, identity stage, encode
  the reply (the stage's output is a new tensor, so it is quantized like any stage output), reply, decode (one message
  each way; payloads over 2 MB travel in block-aligned parts, with encoding, transfer and decoding overlapped);
- ``raw_stream_echo``: the same 1 MiB as a raw fp32 buffer through one long-lived echo stream, one message each
  way: the transport the swarm's channels use, and the baseline of the headline ``ratio_vs_stream_echo``;
- ``hop_8bit_same_host`` (loopback only): the 8-bit hop through the server's same-host Unix socket
  (``lightning_swarm/swarm/wire/same_host.py``) instead of the two p2p daemons, which the other hops cross
  (``same_host=False``); reported as ``hop_ms_same_host`` and ``ratio_same_host_vs_p2p``;
- ``raw_echo``: the same through a unary echo handler (the plain way to call a hivemind peer; reported as
  ``overhead_ratio``, which mixes the codec's gain with the stream's).

Usage: ``python benchmarks/swarm_hop.py [--quick] [--link-mbit 1000]``. With ``--link-mbit`` (root) the trainer
and the server run in two network namespaces joined by a ``tc``-shaped veth link: that is where SWARM lives, and
where the headline is measured (``--link-mbit 1000`` and ``--link-mbit 100``). The last stdout line is one JSON
object with the medians, ``ratio_vs_stream_echo`` (8-bit hop / stream echo), ``floor_ms`` (wire time of the
8-bit hop's encoded bytes, both ways, at the link rate: the physical limit), ``echo_floor_ms`` (the same for the
echo's fp32 bytes), ``ratio_8bit_vs_none`` (the codec's effect through the same stack), the bytes on the wire and
the load average; it is also written to ``runs/swarm_hop/swarm_hop.json`` (loopback) or
``runs/swarm_hop_<rate>mbit/swarm_hop_<rate>mbit.json`` (a shaped link; ``--out``).

The 8-bit hop does two quantizations of 1 MiB (the client's request and the server's reply; ~0.7 ms each with
the fast kernel, ~3 ms with bitsandbytes' own, see ``benchmarks/quantizer_exhaustive.py``), so on a busy machine
the ratios move: the JSON records the load average next to the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import _harness
import hivemind
import numpy as np
import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm.swarm import StageServer, SwarmClient, SwarmSettings
from lightning_swarm.swarm.loop import replicate_p2p, run_coroutine
from lightning_swarm.swarm.wire.codec import COMPRESSIONS, encode_tensor, nbytes

RUN_ID = "swarm_hop_bench"
SHAPE = (64, 4096)  # 262144 floats = 1 MiB of fp32
BLOCK = 4  # calls per variant in a row with --order blocks (the first one untimed)


class Echo(ServicerBase):
    """The baselines: handlers that return their requests' tensors untouched."""

    async def rpc_echo(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def rpc_echo_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for request in requests:
            yield runtime_pb2.ExpertResponse(tensors=request.tensors)


class StreamEcho:
    """One long-lived echo stream, one message at a time: the transport a swarm channel uses."""

    def __init__(self, stub) -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()

        async def outgoing():
            while True:
                yield await self.outbox.get()

        async def open_stream():
            return await stub.rpc_echo_stream(outgoing())

        self.replies = run_coroutine(open_stream(), timeout=30)

    async def call(self, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        self.outbox.put_nowait(request)
        return await self.replies.__anext__()

    def close(self) -> None:
        run_coroutine(self.replies.aclose(), timeout=10)


def serve(host: str) -> None:
    """The server process: identity stages (one per compression) and the echo handlers, until stdin closes."""
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"])
    servers = [
        StageServer(
            stage,
            nn.Identity(),
            dht=dht,
            settings=SwarmSettings(
                run_id=RUN_ID, num_stages=len(COMPRESSIONS), target_batch_size=1, compression=compression
            ),
            optimizer_factory=None,
            throughput=1.0,
        ).start()
        for stage, compression in enumerate(COMPRESSIONS)
    ]

    async def _add_echo():
        p2p = await replicate_p2p(dht)
        await Echo().add_p2p_handlers(p2p)
        return p2p

    p2p = run_coroutine(_add_echo(), timeout=60)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    print(json.dumps({"peer_id": dht.peer_id.to_base58(), "maddrs": maddrs}), flush=True)
    sys.stdin.read()  # the benchmark closes our stdin when done
    for server in servers:
        server.shutdown()
    run_coroutine(p2p.shutdown(), timeout=10)
    dht.shutdown()


def measure(host: str, server_info: dict, reps: int, order: str = "blocks", warmup: int = 10) -> dict:
    """The trainer side: time every variant, interleaved; returns the JSON summary."""
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=server_info["maddrs"])
    server_peer = PeerID.from_base58(server_info["peer_id"])
    clients: dict[str, SwarmClient] = {}
    stream_echo: StreamEcho | None = None
    try:
        # the hops go over P2P, as the echoes do; on loopback one more client takes the same-host socket
        settings = SwarmSettings(run_id=RUN_ID, num_stages=len(COMPRESSIONS), same_host=False)
        clients = {c: SwarmClient(dht, settings.replace(compression=c)) for c in COMPRESSIONS}
        same_host = host == "127.0.0.1"
        if same_host:
            clients["same_host"] = SwarmClient(dht, settings.replace(compression="8bit", same_host=True))
        echo_stub = Echo.get_stub(clients["none"].transport(server_peer, 0).stub._p2p, server_peer)

        torch.manual_seed(0)
        x = torch.randn(*SHAPE)

        stream_echo = StreamEcho(echo_stub)

        def echo(send) -> torch.Tensor:  # tensor -> bytes -> RPC -> bytes -> tensor
            request = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=x.numpy().tobytes())])
            reply = run_coroutine(send(request), timeout=35)
            return torch.from_numpy(np.frombuffer(reply.tensors[0].buffer, dtype=np.float32).reshape(SHAPE))

        def raw_echo() -> torch.Tensor:
            return echo(lambda request: echo_stub.rpc_echo(request, timeout=30))

        def raw_stream_echo() -> torch.Tensor:
            return echo(stream_echo.call)

        def hop(stage: int, compression: str) -> torch.Tensor:
            with torch.no_grad():
                return clients[compression].call_stage(stage, x)

        variants = {"raw_echo": raw_echo, "raw_stream_echo": raw_stream_echo}
        for stage, compression in enumerate(COMPRESSIONS):
            variants[f"hop_{compression}"] = lambda s=stage, c=compression: hop(s, c)
        if same_host:
            variants["hop_8bit_same_host"] = lambda: hop(COMPRESSIONS.index("8bit"), "same_host")
        errors = {}
        for name, fn in variants.items():
            out = fn()  # also discovers the peers
            errors[name] = ((out - x).norm() / x.norm()).item()
        times: dict[str, list[float]] = {name: [] for name in variants}
        # interleaved, so that load changes hit every variant alike: one call of each variant in turn
        # (order "calls"), or short runs of each variant in turn (order "blocks", the default): a call that
        # follows a different variant pays for that variant's leftover work in the daemons and the kernel (an
        # 8-bit hop right after a 1 MiB fp32 echo is ~10% slower than right after another hop), so each run's
        # first call is not timed and every variant is timed in its own steady state
        block = 1 if order == "calls" else BLOCK
        rounds = reps if block == 1 else -(reps // -(block - 1))
        for rep in range(warmup + rounds):
            for name, fn in variants.items():
                for call in range(block):
                    start = time.perf_counter()
                    fn()
                    if rep >= warmup and (block == 1 or call > 0) and len(times[name]) < reps:
                        times[name].append((time.perf_counter() - start) * 1e3)
        medians = {name: statistics.median(values) for name, values in times.items()}
        bytes_on_wire = {c: nbytes([encode_tensor(x, c)]) for c in COMPRESSIONS}
        for name in variants:
            print(f"{name:>15}: median {medians[name]:7.2f} ms, rel. error {errors[name]:.4f}", flush=True)
        if same_host:  # the 8-bit hop to a peer of this machine through its socket, not the p2p daemons
            same_host_figures = {
                "hop_ms_same_host": round(medians["hop_8bit_same_host"], 3),
                "ratio_same_host_vs_p2p": round(medians["hop_8bit_same_host"] / medians["hop_8bit"], 3),
            }
        else:
            same_host_figures = {}
        return {
            **same_host_figures,
            "hop_ms": round(medians["hop_8bit"], 3),
            "raw_echo_ms": round(medians["raw_echo"], 3),
            "overhead_ratio": round(medians["hop_8bit"] / medians["raw_echo"], 3),
            "hop_ms_fp16": round(medians["hop_fp16"], 3),
            "hop_ms_none": round(medians["hop_none"], 3),
            "ratio_fp16": round(medians["hop_fp16"] / medians["raw_echo"], 3),
            "ratio_none": round(medians["hop_none"] / medians["raw_echo"], 3),
            # the same hop against an echo over the transport the swarm uses (one long-lived stream), and the
            # codec's own effect (8-bit against uncompressed through the same stack)
            "raw_stream_echo_ms": round(medians["raw_stream_echo"], 3),
            "ratio_vs_stream_echo": round(medians["hop_8bit"] / medians["raw_stream_echo"], 3),
            "ratio_8bit_vs_none": round(medians["hop_8bit"] / medians["hop_none"], 3),
            "bytes_fp32": x.numel() * 4,
            "bytes_on_wire": bytes_on_wire["8bit"],
            "bytes_on_wire_fp16": bytes_on_wire["fp16"],
            "rel_error_8bit": round(errors["hop_8bit"], 5),
            "reps": reps,
            "order": order,
            "load_avg_1m": round(os.getloadavg()[0], 2),  # these figures move a lot on a busy machine
            "cpu_count": os.cpu_count(),
        }
    finally:
        if stream_echo is not None:
            stream_echo.close()
        for client in clients.values():
            client.shutdown()
        dht.shutdown()


def _server_info(server: subprocess.Popen) -> dict:
    line = server.stdout.readline()
    if not line:
        raise RuntimeError("the server process failed to start (see its stderr above)")
    return json.loads(line)


def main() -> None:
    parser = _harness.parser(
        "swarm_hop", __doc__.split("\n\n")[0], quick="fewer repetitions (well under 5 minutes)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="put the trainer and the server in two network namespaces joined by a link shaped to this many "
        "Mbit/s each way (needs root; default: both on loopback, unshaped)",
    )
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to the shaped link")
    parser.add_argument(
        "--order",
        choices=("blocks", "calls"),
        default="blocks",
        help="interleave the variants in runs of 4 calls, the first untimed (blocks: each variant in its own "
        "steady state), or one call at a time (calls: each call follows a different variant)",
    )
    parser.add_argument("--serve", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--client", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--server-info", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    reps = args.reps or (60 if args.quick else 300)
    if args.client is not None:
        print(json.dumps(measure(args.client, json.loads(args.server_info), reps, args.order)), flush=True)
        return
    name = "swarm_hop" if args.link_mbit is None else f"swarm_hop_{args.link_mbit:g}mbit"
    report = _harness.Report(name, args.out)
    this = [sys.executable, os.path.abspath(__file__)]
    if args.link_mbit is None:
        server = _harness.popen(
            [*this, "--serve", "127.0.0.1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            result = measure("127.0.0.1", _server_info(server), reps, args.order)
        finally:
            _harness.stop_with_stdin(server)
        report.finish(result)
        return
    with _harness.link(2, args.link_mbit, delay_ms=args.delay_ms) as net:
        lives = _harness.dies_with_me()
        server = net.popen(
            1,
            [*this, "--serve", net.address(1)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            **lives,
        )
        client = None
        try:
            info = _server_info(server)
            client = net.popen(
                0,
                [
                    *this,
                    "--client",
                    net.address(0),
                    "--server-info",
                    json.dumps(info),
                    "--reps",
                    str(reps),
                    "--order",
                    args.order,
                ],
                stdout=subprocess.PIPE,
                text=True,
                **lives,
            )
            output, _ = client.communicate(timeout=3600)
        finally:
            if client is not None and client.poll() is None:
                _harness.kill_group(client)
            _harness.stop_with_stdin(server)
    lines = output.strip().splitlines()
    if client.returncode != 0 or not lines:
        raise RuntimeError(f"the trainer process failed ({client.returncode}); see its stderr above")
    print("\n".join(lines[:-1]))
    result = json.loads(lines[-1])
    # the physical limit: the encoded bytes, both ways, at the link rate
    floor_ms = 2 * result["bytes_on_wire"] * 8 / (args.link_mbit * 1e6) * 1e3
    echo_floor_ms = 2 * result["bytes_fp32"] * 8 / (args.link_mbit * 1e6) * 1e3
    result.update(
        link_mbit=args.link_mbit,
        delay_ms=args.delay_ms,
        floor_ms=round(floor_ms, 3),
        hop_vs_floor=round(result["hop_ms"] / floor_ms, 3),
        echo_floor_ms=round(echo_floor_ms, 3),
    )
    report.finish(result)


if __name__ == "__main__":
    main()
